"""Population-parallel ES: wall time per generation versus the number of engines K (--engines) on the same
workload, and how much of it is the straggler tail.

Each K runs the same generations of 01_train.py (same seeds, problems and request seeds) on its own pool. The
straggler tail of a member is the part of its rollout after its median episode ended (rollout wall - median
episode seconds; its episodes start together): time its engine spends waiting for the slowest episodes. With one
engine the members' tails add up inside the generation; with K engines other members' work overlaps them.

    python bench/population_parallel.py                          # CPU: the smoke run at TP=1, 8 members, K = 1, 2
    python bench/population_parallel.py --engines=1,2,4 --preset= --model=Qwen/Qwen3-30B-A3B \\
        --tensor_parallel_size=2 --population=16 --case_batch=16   # a GPU node (8 GPUs: K up to 4 at TP=2)
Prints a table and one JSON line (also written to --out).
"""

import importlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[0]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
from agentic_es import cli, data, fileio, models, vllm_platform  # noqa: E402
from agentic_es.pool import EnginePool  # noqa: E402
from agentic_es.stage import prepare_script  # noqa: E402
from report import emit, print_until_reader_gone  # noqa: E402

train = importlib.import_module("01_train")
CPU_WORKLOAD = ["--preset=smoke", "--tensor_parallel_size=1", "--population=8", "--max_turns=3", "--max_new_tokens=48"]


def member_tails(rollout_file: Path, member_timings: list[dict]) -> list[float]:
    """Per member: rollout wall seconds - its median episode's seconds."""
    seconds = {}
    for r in fileio.read_jsonl(rollout_file):
        seconds.setdefault(r["member"], []).append(r["seconds"])
    return [max(0.0, t["rollout"] - statistics.median(seconds[m])) for m, t in enumerate(member_timings)]


def watch_members(pool) -> dict:
    """{member seed: (the engine that evaluated it, its perturb/rollout/restore seconds)}, filled as the pool's
    engines evaluate members (common.evaluate_member, noted where run_generation looks it up)."""
    members, evaluate_member = {}, common.evaluate_member

    def noted(engine, seed, *args, **kwargs):
        records, timings = evaluate_member(engine, seed, *args, **kwargs)
        members[seed] = (pool.engines.index(engine), timings)
        return records, timings

    common.evaluate_member = noted
    return members


def measure(engines: int, overrides: list[str], generations: int, workdir: Path) -> dict:
    cfg = cli.parse_config([*overrides, f"--engines={engines}", f"--run_dir={workdir / f'k{engines}'}"])
    problems = data.training_problems(cfg)
    t0 = time.perf_counter()
    with EnginePool(cfg, models.resolve_model(cfg.model)) as pool:
        start_s = time.perf_counter() - t0
        members, rows = watch_members(pool), []
        for g in range(generations):
            members.clear()
            t = time.perf_counter()
            record = train.run_generation(pool, cfg, problems, g, train.member_fitness(cfg),
                                          Path(cfg.run_dir) / "rollouts")
            wall = time.perf_counter() - t
            engine_of, member_timings = zip(*(members[seed] for seed in record["seeds"]))  # in member order
            tails = member_tails(Path(cfg.run_dir) / "rollouts" / f"generation-{g:03d}.jsonl", member_timings)
            rows.append({"wall_s": wall, "member_s": sum(t["rollout"] + t["perturb"] + t["restore"]
                                                         for t in member_timings),
                         "tail_s": sum(tails), "digests": record["digests"],
                         "members_per_engine": [engine_of.count(k) for k in range(pool.size)]})
    mean = lambda key: round(statistics.mean(r[key] for r in rows), 2)  # noqa: E731
    return {"engines": pool.size, "engine_start_s": round(start_s, 1), "generation_wall_s": mean("wall_s"),
            "member_seconds_per_generation": mean("member_s"), "straggler_tail_s_per_generation": mean("tail_s"),
            "members_per_engine": rows[-1]["members_per_engine"], "final_digests": rows[-1]["digests"]}


def main(argv):
    opts, overrides = cli.parse_args(argv, {"engines": "1,2", "generations": 2, "out": ""})
    overrides = overrides if any(a.startswith("--preset=") for a in overrides) else [*CPU_WORKLOAD, *overrides]
    overrides = [a for a in overrides if a != "--preset="]
    cfg = cli.parse_config(overrides)
    with tempfile.TemporaryDirectory(prefix="population-parallel-") as tmp:
        runs = [measure(int(k), overrides, opts["generations"], Path(tmp)) for k in opts["engines"].split(",")]
    base = runs[0]["generation_wall_s"]
    for run in runs:
        run["speedup"] = round(base / run["generation_wall_s"], 2)
        run["tail_share_of_wall"] = round(run["straggler_tail_s_per_generation"] / run["generation_wall_s"], 3)
    print(f"{'K':>3} {'start s':>8} {'gen wall s':>10} {'member-s':>9} {'tail s':>7} {'tail/wall':>9} {'speedup':>8}")
    for r in runs:
        print(f"{r['engines']:>3} {r['engine_start_s']:>8} {r['generation_wall_s']:>10} "
              f"{r['member_seconds_per_generation']:>9} {r['straggler_tail_s_per_generation']:>7} "
              f"{r['tail_share_of_wall']:>9} {r['speedup']:>8}")
    same = all(r["final_digests"] == runs[0]["final_digests"] for r in runs)
    return emit({"bench": "population_parallel", "date": time.strftime("%Y-%m-%d"),
                 "device": vllm_platform.device_type(),
                 "model": cfg.model, "tensor_parallel_size": cfg.tensor_parallel_size, "population": cfg.population,
                 "case_batch": cfg.case_batch, "generations": opts["generations"], "same_weights_for_every_k": same,
                 "runs": [{k: v for k, v in r.items() if k != "final_digests"} for r in runs]}, opts["out"])


if __name__ == "__main__":
    print_until_reader_gone()
    prepare_script()
    main(sys.argv[1:])
