"""The base model's strict score per task tier: how often the unchanged agent makes a bash call and then states the
correct final answer (the agent's own score, what --fitness=agent trains on), on N held-out problems x K samples of
each tier. ES can lift a strict score only where the base is clearly above 0 and below its ceiling: this picks the
strict preset's tier (settings.PRESETS["strict"], learn_digits), and shows the compute task's levels (compute_task.py).

    python bench/strict_base.py --tiers=0,3,4,6,8 --problems=64 --samples=8 --tensor_parallel_size=1 \
        --out=strict_base_h100.json --episodes=strict_base_h100_episodes.jsonl   # one H100, the preset's model
    bash run_cpu.sh python bench/strict_base.py --model=tiny-qwen3-dense --tiers=0,3 --problems=2 --samples=2 \
        --max_turns=2 --max_new_tokens=32                                  # CPU check of the pipeline
    python bench/strict_base.py --preset=compute --tiers=compute1,compute2,compute3 --problems=64 --samples=8 \
        --tensor_parallel_size=1 --out=compute_base_h100.json     # the compute task's levels, its preset's budgets

Script options (defaults in OPTIONS): out (the report as a file too), tiers (comma-separated: a number is a tier
of the learn task, Config.learn_digits, evaluated on its held-out additions, as 03_eval.py evaluates them; computeL
is level L of the compute task, Config.compute_level, evaluated on its compute_heldout set, compute_familiesL on its
compute_families set; anything else is a problems file, e.g. data/dapo_test100.jsonl), problems (the first N of each
tier's set), samples (K per problem, sample indices 0..K-1 as 03_eval.py numbers them, so the seeds are the
evaluation's), episodes (a JSONL file that gets every episode's record with its conversation and its tier). Every
other --key=value is a Config override of --preset=strict (model, max_turns, max_new_tokens, temperature, engines,
...; --preset=compute takes that preset's budgets instead).

Per tier: the strict mean (the mean agent score over the N x K episodes, 03_eval.py's mean@16 at K samples) with a
95% percentile-bootstrap interval over problems, pass@K (problems solved at least once), the bash-call rate, the
shaped reward (learn_task.shaped_reward), mean turns, how episodes ended, seconds, and the first episode's
conversation. One read-only engine pool serves every tier. With --out, the report is written after each tier (with
"partial": true until the last), so a run stopped at a time limit keeps the tiers it finished.
"""

import collections
import dataclasses
import re
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[0]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
import learning  # noqa: E402
from agentic_es import cli, data, fileio, learn_task, models, settings, stage, vllm_platform  # noqa: E402
from agentic_es.stage import prepare_script  # noqa: E402
from agentic_es.pool import EnginePool  # noqa: E402
from report import emit, print_until_reader_gone  # noqa: E402

OPTIONS = {"out": "", "tiers": "0,3,4,6,8", "problems": 64, "samples": 8, "episodes": ""}
COMPUTE_TIER = re.compile(r"(compute|compute_families)(\d+)")  # computeL: level L's compute_heldout set


def tier_problems(tier: str, cfg: common.Config, n: int) -> list[dict]:
    """The first n problems of a tier: a learn_digits value's held-out additions, a compute level's held-out
    problems (computeL: compute_heldout, compute_familiesL: compute_families), or a problems file's rows."""
    compute = COMPUTE_TIER.fullmatch(tier)
    if tier.isdigit():
        common.Config(**{**dataclasses.asdict(cfg), "train_data": "learn", "learn_digits": int(tier)})  # checked
        problems = data.problems_from("learn_heldout", cfg.run_seed, int(tier))
    elif compute:
        name, level = compute.group(1), int(compute.group(2))
        common.Config(**{**dataclasses.asdict(cfg), "train_data": "compute", "learn_digits": 0,
                         "compute_level": level})  # checked
        problems = data.problems_from("compute_heldout" if name == "compute" else name, cfg.run_seed,
                                      compute_level=level)
    else:
        problems = data.problems_from(tier, cfg.run_seed)
    return problems[:n]


def tier_row(tier: str, problems: list[dict], records: list[dict], samples: int, seconds: float) -> dict:
    strict = learning.per_problem_means(records, problems, common.agent_reward)
    mean, low, high = learning.bootstrap_ci(strict, np.random.default_rng(0))
    return {"tier": tier, "problems": len(problems), "samples": samples, "strict": mean, "strict_ci": [low, high],
            "pass_at_k": float((strict > 0).mean()),
            "bash_call_rate": float(np.mean([r["bash_calls"] > 0 for r in records])),
            "shaped": float(np.mean([learn_task.shaped_reward(r) for r in records])),
            "mean_turns": float(np.mean([r["turns"] for r in records])),
            "finish": dict(collections.Counter(r["finish_reason"] for r in records)),
            "score_methods": dict(collections.Counter(r["score_method"] for r in records).most_common(6)),
            "seconds": round(seconds, 1),
            "first_episode": records[0]["messages"][1:]}  # what the model wrote (after the system prompt)


def format_table(rows: list[dict]) -> str:
    header = ["tier", "N x K", "strict [95% CI]", "pass@K", "bash calls", "shaped", "turns", "seconds"]
    lines = [header] + [[r["tier"], f"{r['problems']} x {r['samples']}",
                         f"{r['strict']:.3f} [{r['strict_ci'][0]:.3f}, {r['strict_ci'][1]:.3f}]",
                         f"{r['pass_at_k']:.3f}", f"{r['bash_call_rate']:.3f}", f"{r['shaped']:.3f}",
                         f"{r['mean_turns']:.2f}", f"{r['seconds']:.0f}"] for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths)))
                     for line in lines)


def main(argv: list[str]) -> dict:
    opts, overrides = cli.parse_args(argv, OPTIONS)
    cfg = cli.parse_config(["--preset=strict", *overrides])
    if opts["problems"] < 1 or opts["samples"] < 1:
        raise stage.ConfigError("--problems and --samples must be at least 1")
    tiers = [t.strip() for t in str(opts["tiers"]).split(",") if t.strip()]
    sets = {tier: tier_problems(tier, cfg, opts["problems"]) for tier in tiers}  # every tier checked first
    common.check_sandbox(cfg, data=[t for t in tiers if not t.isdigit() and not COMPUTE_TIER.fullmatch(t)])
    stage.check_scorer()  # as the stages: a broken scorer would score every answer 0
    rows = []
    report = {"bench": "strict_base", "date": time.strftime("%Y-%m-%d %H:%M"), "argv": argv, "model": cfg.model,
              "device": vllm_platform.device_type(), "config": dataclasses.asdict(cfg),
              "ci": f"95% percentile bootstrap over problems, {learning.BOOTSTRAP} resamples", "tiers": rows}
    with EnginePool(cfg, models.resolve_model(cfg.model), perturbs=False) as engines:
        for tier, problems in sets.items():
            t0 = time.perf_counter()
            records = engines.run_agent([(p, i) for p in problems for i in range(opts["samples"])],
                                        desc=f"tier {tier}")
            stage.check_scorer_failures(records, f"tier {tier}", "its row is not written (docs/scoring.md)")
            rows.append(tier_row(tier, problems, records, opts["samples"], time.perf_counter() - t0))
            if opts["episodes"]:
                fileio.append_jsonl(opts["episodes"], [dict(r, tier=tier) for r in records])
            if opts["out"]:  # each finished tier at once: a run stopped at a time limit keeps the tiers it finished
                fileio.write_json_atomic(dict(report, partial=len(rows) < len(sets)), opts["out"])
            print(format_table(rows), flush=True)
    return emit(report, opts["out"])


if __name__ == "__main__":
    print_until_reader_gone()
    prepare_script()
    main(sys.argv[1:])
