"""restore="patch" against restore="copy_device": what an exact restore without a weight copy costs and saves.

One engine per restore mode, one after the other (the first closed before the second starts). Per mode and member
(M members, perturbed then restored, timed from the driver): perturb and restore seconds, and whether every rank's
digest after the restore is the centre's. For the patch: the elements the subtraction missed per member and rank (a
share of the elements), the patch's reserved and used bytes as a share of a copy's. Then the memory plan's largest
admitted K (engines per GPU) for copy_device, copy_host and patch, from the engine's real weights and patch bytes
and the GPU's measured free and total memory, at the smallest gpu_memory_utilization holding one engine's weights,
activations and one max_model_len sequence, and at the configured one; and per K, the KV cache each engine keeps
at the largest utilization admitting K. vLLM's dummy weights (uniform in +-1e-3, smaller than the noise) would miss
far more often than trained weights: with --normal_weights=true (always with --qwen3_30b) every weight is redrawn
N(0, 0.02), norms 1, as bench/qwen3_30b.write_random_checkpoint writes them.

--synthetic=true measures the miss fraction without vLLM on bf16 N(0, std) tensors (std 0.02, 0.01, 0.005; sigma 1e-3
and 5e-4; both roundings): the measurement behind restore_patch.PATCH_CAPACITY.

    python bench/exact_restore.py --qwen3_30b=true --layers=24 --tensor_parallel_size=1 --out=$OUT/exact_restore.json
    bash run_cpu.sh python bench/exact_restore.py --preset=smoke --out=bench/results/exact_restore_cpu.json
    bash run_cpu.sh python bench/exact_restore.py --synthetic=true
"""

import dataclasses
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[0]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
import qwen3_30b  # noqa: E402
from agentic_es import cli, models, placement, restore_patch, settings, stage, stochastic_rounding, worker_memory  # noqa: E402
from agentic_es.engine import Engine  # noqa: E402
from report import emit, print_until_reader_gone  # noqa: E402

RESTORES = ("patch", "copy_device")
PLAN_RESTORES = ("copy_device", "copy_host", "patch")
SYNTHETIC_STDS, SYNTHETIC_SIGMAS = (0.02, 0.01, 0.005), (1e-3, 5e-4)


def synthetic(n: int = 4_000_000) -> list[dict]:
    """Miss fractions of the subtraction on bf16 N(0, std), one member, without vLLM."""
    rows = []
    for std in SYNTHETIC_STDS:
        theta = (torch.randn(n, generator=torch.Generator().manual_seed(0)) * std).bfloat16()
        for sigma in SYNTHETIC_SIGMAS:
            for rounding in settings.ROUNDING_MODES:
                patch = restore_patch.RestorePatch([theta], 1.0)
                work = theta.clone()
                patch.start_recording()
                write_ = stochastic_rounding.write_for(work, common.rounding_seed("perturb", [5], 0, "w")
                                              if rounding == "stochastic" else None)
                common.add_noise_through_patch_(patch, work, [common.noise_seed(5, 0, "w")], [sigma], 1 << 20, write_)
                rows.append({"std": std, "sigma": sigma, "rounding": rounding,
                             "miss_fraction": round(patch.used[torch.bfloat16] / n, 5)})
    return rows


def largest_k(restore: str, needs: dict, report: dict, utilization: float, tp: int) -> int:
    """Engines per GPU the memory plan admits with their restore state where `restore` asks (0: not one)."""
    k = 0
    while k < 64:
        try:
            plan = placement.plan_gpu_memory(engines_per_gpu=k + 1, engines_on_node=k + 1,
                                        gpu_total=report["gpu_total_bytes"], gpu_free=report["gpu_free_bytes"],
                                        host_free=report["host_free_bytes"], utilization=utilization, restore=restore,
                                        tensor_parallel_size=tp, **needs)
        except stage.ConfigError:
            break
        if plan["restore"] != restore:
            break
        k += 1
    return k


def best_utilization(k: int, restore: str | None, needs: dict, report: dict, tp: int) -> tuple[float, dict] | None:
    """The largest gpu_memory_utilization (in steps of 0.01) at which the memory plan admits k engines per GPU with
    their restore state where `restore` asks, and that plan; None when none does."""
    for step in range(99, 0, -1):
        try:
            plan = placement.plan_gpu_memory(engines_per_gpu=k, engines_on_node=k, gpu_total=report["gpu_total_bytes"],
                                        gpu_free=report["gpu_free_bytes"], host_free=report["host_free_bytes"],
                                        utilization=step / 100, restore=restore, tensor_parallel_size=tp, **needs)
        except stage.ConfigError:
            continue
        if plan["restore"] == restore:
            return step / 100, plan
    return None


def plans_by_k(restore: str | None, needs: dict, report: dict, tp: int) -> dict:
    """{K: (the largest gpu_memory_utilization admitting K engines per GPU with their restore state where `restore`
    asks, that plan)} for K = 1, 2, ... up to the first K that fits at none (at most 64)."""
    out = {}
    for k in range(1, 65):
        if (found := best_utilization(k, restore, needs, report, tp)) is None:
            break
        out[k] = found
    return out


def kv_cache_by_k(restore: str, needs: dict, report: dict, tp: int) -> dict:
    """{K: GiB of KV cache per engine} at the largest gpu_memory_utilization the plan admits for K engines."""
    return {k: round(plan["kv_cache_bytes"] / placement.GIB, 1) for k, (_, plan) in plans_by_k(restore, needs, report,
                                                                                         tp).items()}


def run_mode(cfg, model, load_format, opts, seeds) -> dict:
    t0 = time.perf_counter()
    with Engine(cfg, model, load_format=load_format, skip_tokenizer_init=opts["qwen3_30b"]) as engine:
        start_s = time.perf_counter() - t0
        if opts["normal_weights"]:
            engine.rpc(qwen3_30b.normal_weights, std=qwen3_30b.NORMAL_STD, seed=opts["seed"])
            engine.reset_prefix_cache()
        engine.reserve_restore_copy()  # the copy or the patch, allocated before any member (as a pool's GPU engines)
        centre = engine.digests()
        members = []
        for seed in seeds:
            t = time.perf_counter()
            engine.perturb(seed, cfg.sigma_start)
            perturb_s = time.perf_counter() - t
            memory = engine.rpc(worker_memory.es_memory)
            t = time.perf_counter()
            engine.restore()
            restore_s = time.perf_counter() - t
            members.append({"seed": seed, "perturb_s": round(perturb_s, 3), "restore_s": round(restore_s, 3),
                            "digests_equal_centre": engine.digests() == centre,
                            "miss_fraction_per_rank": [round(m["patch_used"] / m["params"], 5) for m in memory],
                            "patch_used_bytes_per_rank": [m["patch_used"] * m["param_bytes"] // m["params"]
                                                          for m in memory]})
        memory = engine.rpc(worker_memory.es_memory)
    rank0 = memory[0]
    result = {"restore": cfg.restore, "engine_start_s": round(start_s, 1), "members": members,
              "perturb_s_median": round(statistics.median(m["perturb_s"] for m in members), 3),
              "restore_s_median": round(statistics.median(m["restore_s"] for m in members), 3),
              "all_digests_equal_centre": all(m["digests_equal_centre"] for m in members),
              "params_per_rank": rank0["params"], "param_bytes_per_rank": rank0["param_bytes"],
              "copy_bytes_per_rank": rank0["copy_bytes"], "patch_bytes_per_rank": rank0["patch_bytes"]}
    if cfg.restore == "patch":
        result.update(patch_capacity=restore_patch.patch_capacity(cfg),
                      patch_reserved_of_copy=round(rank0["patch_bytes"] / rank0["param_bytes"], 4),
                      patch_used_of_copy_max=round(max(max(m["patch_used_bytes_per_rank"]) for m in members)
                                                   / rank0["param_bytes"], 4),
                      miss_fraction_max=max(max(m["miss_fraction_per_rank"]) for m in members))
    return result


def plan_ks(cfg, model, modes: dict) -> dict | None:
    """The memory plan's largest K per restore mode on this node's first GPU group (None without nvidia-smi)."""
    gpus = placement.visible_gpus()[:cfg.tensor_parallel_size]
    report = placement.node_report(gpus)
    if report["gpu_total_bytes"] is None:
        return None
    config = json.loads((Path(model) / "config.json").read_text())
    needs = placement.engine_memory_needs(config, cfg, model)
    needs.update(weights_bytes=modes["copy_device"]["param_bytes_per_rank"],  # the engine's real bytes
                 patch_bytes=modes["patch"]["patch_bytes_per_rank"])
    smallest = math.ceil((needs["weights_bytes"] + placement.ACTIVATION_RESERVE_BYTES + needs["sequence_kv_bytes"])
                         / report["gpu_total_bytes"] * 100) / 100
    return {"gpu_total_bytes": report["gpu_total_bytes"], "gpu_free_bytes": report["gpu_free_bytes"],
            "host_free_bytes": report["host_free_bytes"], "needs": needs, "smallest_utilization": smallest,
            "k_at_smallest_utilization": {r: largest_k(r, needs, report, smallest, cfg.tensor_parallel_size)
                                          for r in PLAN_RESTORES},
            "kv_cache_gib_per_engine_by_k": {r: kv_cache_by_k(r, needs, report, cfg.tensor_parallel_size)
                                             for r in PLAN_RESTORES},
            "configured_utilization": cfg.gpu_memory_utilization,
            "k_at_configured_utilization": {r: largest_k(r, needs, report, cfg.gpu_memory_utilization,
                                                         cfg.tensor_parallel_size) for r in PLAN_RESTORES}}


def main(argv):
    opts, overrides = cli.parse_args(argv, {"members": 4, "seed": 0, "qwen3_30b": False, "layers": 0,
                                          "normal_weights": False, "synthetic": False, "out": ""})
    if opts["synthetic"]:
        rows = synthetic()
        for r in rows:
            print(f"std {r['std']:<6} sigma {r['sigma']:<7} {r['rounding']:<10} misses {r['miss_fraction']:.4f}")
        return emit({"bench": "exact_restore/synthetic", "date": time.strftime("%Y-%m-%d"), "dtype": "bfloat16",
                     "rows": rows}, opts["out"])
    cfg = cli.parse_config(overrides)
    if opts["qwen3_30b"]:  # the real layout with random weights: only its config.json is needed
        model, load_format = qwen3_30b.write_config("/tmp/qwen3-30b-a3b-exact-restore", layers=opts["layers"]), "dummy"
    else:
        model, load_format = models.resolve_model(cfg.model), "auto"
    opts["normal_weights"] = opts["normal_weights"] or opts["qwen3_30b"]  # dummy weights would say nothing
    qwen3_30b.allow_normal_weights()
    seeds = common.member_seeds(cfg.run_seed, 0, opts["members"])
    modes = {r: run_mode(dataclasses.replace(cfg, restore=r), model, load_format, opts, seeds) for r in RESTORES}
    plan = plan_ks(cfg, model, modes)
    cut = f" cut to {opts['layers']} layers" if opts["layers"] else ""
    result = {"bench": "exact_restore", "date": time.strftime("%Y-%m-%d"),
              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
              "vllm_version": __import__("vllm").__version__,
              "model": f"Qwen3-30B-A3B layout{cut}, dummy weights" if opts["qwen3_30b"] else cfg.model,
              "weights": "N(0, 0.02), norms 1" if opts["normal_weights"] else "as loaded",
              "tensor_parallel_size": cfg.tensor_parallel_size, "dtype": cfg.dtype, "rounding": cfg.rounding,
              "sigma": cfg.sigma_start, "noise_chunk": cfg.noise_chunk, "members": opts["members"],
              "modes": modes, "plan": plan}
    patch = modes["patch"]
    print(f"{'restore':<12} {'perturb s':>10} {'restore s':>10} {'exact':>6} {'bytes of a copy':>16}")
    for r, m in modes.items():
        kept = patch["patch_reserved_of_copy"] if r == "patch" else 1.0
        print(f"{r:<12} {m['perturb_s_median']:>10.3f} {m['restore_s_median']:>10.3f} "
              f"{str(m['all_digests_equal_centre']):>6} {kept:>16.3f}")
    print(f"patch: capacity {patch['patch_capacity']}, misses up to {patch['miss_fraction_max']:.4f} of the elements, "
          f"used up to {patch['patch_used_of_copy_max']:.3f} of a copy's bytes")
    if plan:
        for key in ("k_at_smallest_utilization", "k_at_configured_utilization"):
            util = plan["smallest_utilization" if key.endswith("smallest_utilization") else "configured_utilization"]
            print(f"engines per GPU at gpu_memory_utilization={util}: "
                  + ", ".join(f"{r} {k}" for r, k in plan[key].items()))
        for r, by_k in plan["kv_cache_gib_per_engine_by_k"].items():
            print(f"{r:<12} KV cache GiB per engine at the largest utilization admitting K engines per GPU: "
                  + ", ".join(f"K={k}: {gib}" for k, gib in by_k.items()))
    return emit(result, opts["out"])


if __name__ == "__main__":
    print_until_reader_gone()
    main(sys.argv[1:])
