"""Evaluation without restore memory: how many engines the memory plan admits for an evaluation when every engine
holds an exact-restore copy (before: 03_eval.py started its pool with the run's restore mode) and when it holds none
(a read-only pool), and the evaluation's episodes/s at each of those K on one GPU under MPS. Then the reference's
evaluation (2x H200, TP=2, 48 layers) projected from it.

The plan: per restore mode (copies on the GPU, in pinned host memory, patches, none), the largest K engines per GPU
it admits and the largest gpu_memory_utilization (in steps of 0.01) admitting that K, from this GPU's measured free
memory and the engine's bytes. The measurement: the same evaluation twice, "before" on K engines of a pool that
perturbs (each takes its copy at start, on the GPU) and "after" on K engines of a read-only pool, each at its
plan's utilization (--ks_after=3,4: read-only pools at those K too). The evaluation is the reference workload's
scripted episodes (bench/reference_generation.py: real requests with drawn token budgets, observations and tool
seconds; a random model never stops by itself), problems x samples of them spread over the pool as 03_eval.py
spreads them (contiguous slices handed to free engines), every episode at once on its engine. The same episodes in
every run (seeds by episode index).

The projection: the reference's per-GPU plan (Qwen3-30B-A3B, TP=2, from its config) on this GPU's numbers gives K
per GPU pair before and after; one GPU pair at TP=2 holds per GPU the bytes one engine of the 24-layer layout at
TP=1 holds here, which is why that layout is measured. The projected hours assume that a pair generates as fast as
this GPU did at the same K and that full-length episodes keep the short episodes' tokens/s (an optimistic bound).

    bash bench/eval_memory_h200.sh $OUT                      # one H200: MPS on, then the command below, MPS off
    python bench/eval_memory.py --qwen3_30b=true --layers=24 --tensor_parallel_size=1 \
        --cudagraph_mode=FULL_DECODE_ONLY --out=$OUT/eval_memory_h200x1_24layers.json
    bash run_cpu.sh python bench/eval_memory.py --replan=bench/results/eval_memory_h200x1_24layers.json \
        --out=eval_memory_replan.json                        # the projection again from a report (no GPU;
                                                             # --host_free_gib=N: another host's free memory)
    bash run_cpu.sh python bench/eval_memory.py --preset=smoke --tensor_parallel_size=1 --problems=2 --samples=2 \
        --token_scale=0.02 --tool_scale=0.1                  # CPU: the pipeline only (no plan without nvidia-smi)
"""

import asyncio
import concurrent.futures
import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[0]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
import qwen3_30b  # noqa: E402
from agentic_es import cli, metrics, models, placement, pool, worker_memory  # noqa: E402
from exact_restore import best_utilization, plans_by_k  # noqa: E402
from reference_generation import FIRST_PROMPT_TOKENS, draw_episode, scripted_episode  # noqa: E402
from report import emit, print_until_reader_gone  # noqa: E402

PLAN_MODES = ("copy_device", "copy_host", "patch", None)  # None: a read-only pool, no restore memory
BEFORE = "copy_device"  # the default restore mode, its copies on the GPU: what evaluation pools held before
REFERENCE_EVAL_SETS = ("dapo_test100.jsonl", "aime2026.jsonl")  # 03_eval.py's sets, counted in data_manifest.json
REFERENCE_TP = 2


def mode_name(restore: str | None) -> str:
    return restore or "none (read-only)"


def plan_rows(needs: dict, report: dict, tp: int) -> dict:
    """Per restore mode: the largest K engines per GPU the plan admits, at the largest utilization admitting it,
    with each engine's KV cache and restore memory (GiB)."""
    rows = {}
    for restore in PLAN_MODES:
        by_k = plans_by_k(restore, needs, report, tp)
        k = max(by_k, default=0)
        utilization, plan = by_k.get(k, (None, {}))
        rows[mode_name(restore)] = {
            "restore": restore, "engines_per_gpu": k, "gpu_memory_utilization": utilization,
            "kv_cache_gib_per_engine": round(plan.get("kv_cache_bytes", 0) / placement.GIB, 1),
            "restore_gib_per_engine_on_gpu": round((plan.get("device_copy_bytes", 0)
                                                    + plan.get("device_patch_bytes", 0)) / placement.GIB, 1),
            "restore_gib_per_engine_on_host": round(plan.get("host_copy_bytes", 0) / placement.GIB, 1)}
    return rows


def gpu_plan(cfg, model: str) -> dict | None:
    """The memory plan's rows on this node's first GPU group (None without nvidia-smi), and the engine's needs."""
    report = placement.node_report(placement.visible_gpus()[:cfg.tensor_parallel_size])
    if report["gpu_total_bytes"] is None:
        return None
    needs = placement.engine_memory_needs(json.loads((Path(model) / "config.json").read_text()), cfg, model)
    return {"gpu_total_bytes": report["gpu_total_bytes"], "gpu_free_bytes": report["gpu_free_bytes"],
            "host_free_bytes": report["host_free_bytes"], "needs": needs,
            "rows": plan_rows(needs, report, cfg.tensor_parallel_size), "report": report}


def episode_tokens(plan: dict, max_model_len: int) -> int:
    """The tokens scripted_episode generates for a drawn episode: each turn's budget, cut where the context is full."""
    length, generated = FIRST_PROMPT_TOKENS, 0
    for turn, (budget, observation) in enumerate(zip(plan["budgets"], plan["observations"])):
        room = max_model_len - length
        if room <= 0:
            break
        generated += min(budget, room)
        length += min(budget, room) + (observation if turn < len(plan["budgets"]) - 1 else 0)
    return generated


def reference_eval_episodes() -> int:
    """Episodes of the reference's 16-sample evaluation: the problems of its sets (data_manifest.json) x 16."""
    manifest = json.loads((common.REPO / "data_manifest.json").read_text())
    return sum(len(manifest["files"][name]["rows"]) for name in REFERENCE_EVAL_SETS) * metrics.EVAL_SAMPLES


def projection(report: dict, phases: dict, seed: int, max_model_len: int) -> dict:
    """The reference's evaluation on 2x H200 at TP=2: engines per GPU pair before and after from its own plan on this
    GPU's numbers, and its hours at the tokens/s measured here at the same K (see the module's docstring)."""
    cfg = common.Config(tensor_parallel_size=REFERENCE_TP, max_model_len=max_model_len)
    needs = placement.engine_memory_needs(qwen3_30b.QWEN3_30B_A3B, cfg)
    rows = plan_rows(needs, report, REFERENCE_TP)
    episodes = reference_eval_episodes()
    tokens = sum(episode_tokens(draw_episode(seed, e // metrics.EVAL_SAMPLES, e % metrics.EVAL_SAMPLES, 1.0),
                                max_model_len) for e in range(episodes))
    out = {"model": "Qwen3-30B-A3B, 48 layers, TP=2", "per_gpu_needs": needs, "episodes": episodes,
           "tokens_per_episode_mean": round(tokens / episodes), "engines_per_gpu_pair": {}, "hours": {}}
    for name, restore in (("before", BEFORE), ("after", None)):
        row = rows[mode_name(restore)]
        out["engines_per_gpu_pair"][name] = row["engines_per_gpu"]
        out[f"kv_cache_gib_per_engine_{name}"] = row["kv_cache_gib_per_engine"]
        measured = phases.get(name)
        if measured and measured["engines"] == row["engines_per_gpu"]:  # measured here at the same K
            out["hours"][name] = round(tokens / measured["tokens_per_s"] / 3600, 2)
    if len(out["hours"]) == 2:
        out["after_over_before"] = round(out["hours"]["after"] / out["hours"]["before"], 3)
    out["host_free_bytes"] = report["host_free_bytes"]  # what copy_host's rows were planned with
    out["by_k"] = {}
    for restore in PLAN_MODES:
        out["by_k"][mode_name(restore)] = {
            k: {"gpu_memory_utilization": utilization,
                "kv_cache_gib_per_engine": round(plan["kv_cache_bytes"] / placement.GIB, 1),
                "host_copy_gib_per_engine": round(plan.get("host_copy_bytes", 0) / placement.GIB, 1)}
            for k, (utilization, plan) in plans_by_k(restore, needs, report, REFERENCE_TP).items()}
    return out


def replan(path: str, host_free_gib: float = 0) -> dict:
    """The projection again from a report's stored GPU numbers (no GPU needed): what the plan admits for the
    reference at each K, per restore mode; host_free_gib: the host memory free, where not the report's."""
    result = json.loads(Path(path).read_text())
    report = {k: result["plan"][k] for k in ("gpu_total_bytes", "gpu_free_bytes", "host_free_bytes")}
    if host_free_gib:  # the projection records it; the report's own plan stays as measured
        report["host_free_bytes"] = int(host_free_gib * placement.GIB)
    result["projection"] = projection(report, result["phases"], result["seed"], result["max_model_len"])
    return result


def evaluate(engines: pool.EnginePool, plans: list[dict], vocab: int) -> dict:
    """Every scripted episode on the pool: contiguous slices, one per engine, taken by free engines (as run_agent),
    each slice's episodes all at once. Episode i's requests are seeded by i, whatever engine runs it."""
    size = max(1, math.ceil(len(plans) / engines.size))
    starts = list(range(0, len(plans), size))

    def run(engine, i, on_record):
        async def episodes():
            with concurrent.futures.ThreadPoolExecutor(max_workers=common.SANDBOX_MAX_PARALLEL) as tools:
                return await asyncio.gather(*(scripted_episode(engine, plans[e], e, vocab, tools)
                                              for e in range(starts[i], min(starts[i] + size, len(plans)))))
        return engine._run(episodes())

    t0 = time.perf_counter()
    records = [r for batch in engines.work(len(starts), "episodes", "slice", run) for r in batch]
    wall = time.perf_counter() - t0
    ends = sorted(r["end"] - t0 for r in records)
    tokens = sum(r["tokens"] for r in records)
    return {"episodes": len(records), "wall_s": round(wall, 1), "episodes_per_s": round(len(records) / wall, 3),
            "generated_tokens": tokens, "tokens_per_s": round(tokens / wall, 1),
            "median_end_s": round(statistics.median(ends), 1), "last_end_s": round(ends[-1], 1),
            "context_full": sum(r["finish"] == "context_full" for r in records)}


def run_phase(name: str, cfg, model: str, opts: dict, plans: list[dict], perturbs: bool) -> dict:
    """One pool (perturbing, or read-only), started and timed, weights redrawn, then the evaluation."""
    kwargs = {"load_format": "dummy", "skip_tokenizer_init": True} if opts["qwen3_30b"] else {}
    t0 = time.perf_counter()
    with pool.EnginePool(cfg, model, perturbs=perturbs, **kwargs) as engines:
        start_s = time.perf_counter() - t0
        for engine in engines.engines:
            if opts["normal_weights"]:
                engine.rpc(qwen3_30b.normal_weights, std=qwen3_30b.NORMAL_STD, seed=opts["seed"])
            engine.reset_prefix_cache()
        memory = [engine.rpc(worker_memory.es_memory)[0] for engine in engines.engines]
        devices = engines.rpc(common.ESWorker.es_device)
        gpu_after_start = (placement.node_report(placement.visible_gpus()[:cfg.tensor_parallel_size])["gpu_free_bytes"]
                           if engines.device == "cuda" else None)
        vocab = json.loads((Path(model) / "config.json").read_text())["vocab_size"]
        result = evaluate(engines, plans, vocab)
        where = engines.placement
    result.update(phase=name, engines=engines.size, restore=cfg.restore if perturbs else "none (read-only)",
                  gpu_memory_utilization=cfg.gpu_memory_utilization, engines_start_s=round(start_s, 1),
                  restore_bytes_per_engine=[m["copy_bytes"] + m["patch_bytes"] for m in memory],
                  restore_on=[m["copy_device"] for m in memory], gpu_free_bytes_after_start=gpu_after_start,
                  devices=devices, placement=where)
    print(f"[eval_memory] {name}: K={result['engines']} ({result['restore']}), {result['episodes']} episodes in "
          f"{result['wall_s']} s = {result['episodes_per_s']} episodes/s, {result['tokens_per_s']} tok/s; engines "
          f"started in {result['engines_start_s']} s", flush=True)
    return result


def print_tables(result: dict) -> None:
    if result["plan"]:
        print(f"{'restore':<18} {'engines/GPU':>11} {'utilization':>11} {'KV GiB/engine':>13} "
              f"{'restore GiB GPU':>15} {'restore GiB host':>16}")
        for name, row in result["plan"]["rows"].items():
            print(f"{name:<18} {row['engines_per_gpu']:>11} {str(row['gpu_memory_utilization']):>11} "
                  f"{row['kv_cache_gib_per_engine']:>13} {row['restore_gib_per_engine_on_gpu']:>15} "
                  f"{row['restore_gib_per_engine_on_host']:>16}")
    print(f"{'phase':<8} {'K':>3} {'restore':<18} {'episodes':>8} {'wall s':>8} {'episodes/s':>10} {'tok/s':>9} "
          f"{'start s':>8}")
    for name, p in result["phases"].items():
        print(f"{name:<8} {p['engines']:>3} {p['restore']:<18} {p['episodes']:>8} {p['wall_s']:>8} "
              f"{p['episodes_per_s']:>10} {p['tokens_per_s']:>9} {p['engines_start_s']:>8}")
    ref = result.get("projection")
    if ref and "by_k" in ref:
        print(f"{'reference plan (TP=2)':<22} {'K':>3} {'utilization':>11} {'KV GiB/engine':>13} {'host copy GiB':>13}")
        for name, by_k in ref["by_k"].items():
            for k, row in by_k.items():
                print(f"{name:<22} {k:>3} {row['gpu_memory_utilization']:>11} {row['kv_cache_gib_per_engine']:>13} "
                      f"{row['host_copy_gib_per_engine']:>13}")
    if ref:
        print(f"reference evaluation (2x H200, TP=2): {ref['episodes']} episodes, ~{ref['tokens_per_episode_mean']} "
              f"tokens each; engines per GPU pair before {ref['engines_per_gpu_pair']['before']}, after "
              f"{ref['engines_per_gpu_pair']['after']}; projected hours {ref['hours']}")


def main(argv):
    opts, overrides = cli.parse_args(argv, {"problems": 8, "samples": 16, "token_scale": 0.1, "tool_scale": 0.1,
                                            "seed": 0, "qwen3_30b": False, "layers": 0, "normal_weights": False,
                                            "ks_after": "", "replan": "", "host_free_gib": 0.0, "out": ""})
    cfg = cli.parse_config(overrides)
    if opts["replan"]:  # no engine: the projection from a report's GPU numbers
        result = replan(opts["replan"], opts["host_free_gib"])
        print_tables(result)
        return emit(result, opts["out"])
    if opts["qwen3_30b"]:  # the real layout with random weights: only its config.json is needed
        model = qwen3_30b.write_config("/tmp/qwen3-30b-a3b-eval-memory", layers=opts["layers"])
    else:
        model = models.resolve_model(cfg.model)
    opts["normal_weights"] = opts["normal_weights"] or opts["qwen3_30b"]  # weights N(0, 0.02), as trained ones
    if opts["normal_weights"]:
        qwen3_30b.allow_normal_weights()
    plan = gpu_plan(cfg, model)
    if plan:
        ks = {"before": plan["rows"][mode_name(BEFORE)]["engines_per_gpu"],
              "after": plan["rows"][mode_name(None)]["engines_per_gpu"]}
        if max(ks.values()) > 1 and not placement.mps_running():
            sys.exit("[eval_memory] co-located engines are measured under CUDA MPS: start it first "
                     "(bench/eval_memory_h200.sh does)")
    else:  # no GPU plan (CPU): the pipeline with --engines (default 1) in both phases
        ks = {"before": cfg.engines or 1, "after": cfg.engines or 1}
    plans = [draw_episode(opts["seed"], p, s, opts["token_scale"])
             for p in range(opts["problems"]) for s in range(opts["samples"])]
    for episode in plans:
        episode["tool_seconds"] = [t * opts["tool_scale"] for t in episode["tool_seconds"]]
    cut = f" cut to {opts['layers']} layers" if opts["layers"] else ""
    result = {"bench": "eval_memory", "date": time.strftime("%Y-%m-%d"), "device": None,  # (the engines' own)
              "vllm_version": __import__("vllm").__version__,
              "model": f"Qwen3-30B-A3B layout{cut}, dummy weights" if opts["qwen3_30b"] else cfg.model,
              "weights": "N(0, 0.02), norms 1" if opts["normal_weights"] else "as loaded",
              "tensor_parallel_size": cfg.tensor_parallel_size, "max_model_len": cfg.max_model_len,
              "cudagraph_mode": cfg.cudagraph_mode, "mps": placement.mps_running() if plan else None,
              "problems": opts["problems"], "samples": opts["samples"], "token_scale": opts["token_scale"],
              "tool_scale": opts["tool_scale"], "seed": opts["seed"],
              "plan": {k: v for k, v in plan.items() if k != "report"} if plan else None, "phases": {}}
    # read-only pools at the plan's largest K, or at each K of --ks_after (e.g. "3,4": named after_k3 and after)
    after_ks = [int(k) for k in opts["ks_after"].split(",") if k.strip()] or [ks["after"]]
    phases = [("before", ks["before"], BEFORE)] + [("after" if k == ks["after"] else f"after_k{k}", k, None)
                                                   for k in after_ks]
    for name, k, restore in phases:
        fits = best_utilization(k, restore, plan["needs"], plan["report"], cfg.tensor_parallel_size) if plan else None
        phase_cfg = dataclasses.replace(cfg, engines=k, restore=BEFORE,
                                        gpu_memory_utilization=fits[0] if fits else cfg.gpu_memory_utilization)
        result["phases"][name] = run_phase(name, phase_cfg, model, opts, plans, perturbs=restore is not None)
        result["device"] = result["phases"][name]["devices"][0]["name"]
        if opts["out"]:  # after each phase: a run stopped by its time limit keeps what it measured
            Path(opts["out"]).write_text(json.dumps(result, indent=2))
    if plan:
        result["projection"] = projection(plan["report"], result["phases"], opts["seed"], cfg.max_model_len)
    print_tables(result)
    return emit(result, opts["out"])


if __name__ == "__main__":
    print_until_reader_gone()
    main(sys.argv[1:])
