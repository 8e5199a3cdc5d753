"""What checkpoint noise costs: perturb, restore, an N-member update and the digest per noise mode, on one model.

The rank-salted noise draws torch.randn per (member, rank, parameter); the checkpoint noise computes each element's
normal from a counter hash with integer and IEEE basic operations (about 60 elementwise kernels per chunk) and
reads the runtime-to-checkpoint layout. Prints a table and one JSON line (also written to --out).

    python bench/noise_modes.py --model=smollm2-135m --out=bench/results/noise_modes_cpu.json   # CPU, TP=2
    python bench/noise_modes.py --qwen3_30b=true --layers=12 --tensor_parallel_size=1 --cuda_graphs=false \
        --gpu_memory_utilization=0.5 --out=$OUT/noise_modes_h200x1.json   # one H200: random weights, real files
"""

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[0]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
import qwen3_30b  # noqa: E402
from agentic_es import cli, models, settings, vllm_platform, worker_memory  # noqa: E402
from agentic_es.engine import Engine  # noqa: E402
from agentic_es.stage import prepare_script  # noqa: E402
from report import emit, print_until_reader_gone  # noqa: E402


def seconds_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(cfg, path: str, repeats: int, population: int) -> dict:
    with Engine(cfg, path, skip_tokenizer_init=True) as engine:
        t0 = time.perf_counter()
        engine.digests()  # the first call derives the checkpoint layout (checkpoint noise)
        first_digest = time.perf_counter() - t0
        seeds = common.member_seeds(cfg.run_seed, 0, population)
        coeffs = common.update_coefficients(common.zscore(list(range(population))), cfg.alpha)
        return {
            "noise": cfg.noise,
            "params_per_rank": (sum(r["params"] for r in engine.rpc(worker_memory.es_memory))
                                // cfg.tensor_parallel_size),
            "first_digest_s": round(first_digest, 3),
            "perturb_restore_s": round(seconds_of(lambda: (engine.perturb(seeds[0], cfg.sigma_start), engine.restore()),
                                          repeats), 3),
            "update_s": round(seconds_of(lambda: engine.update(seeds, coeffs), 1), 3),
            "digest_s": round(seconds_of(engine.digests, repeats), 3),
        }


def main(argv):
    opts, overrides = cli.parse_args(argv, {"out": "", "repeats": 3, "population": 8, "qwen3_30b": False, "layers": 0})
    cfg = cli.parse_config(["--preset=smoke", *overrides])
    if opts["qwen3_30b"]:  # the real layout (cut to `layers`), random weights written as real safetensors files
        t0 = time.perf_counter()
        folder = qwen3_30b.write_config(f"/tmp/qwen3-30b-a3b-checkpoint-{opts['layers']}", layers=opts["layers"])
        path = qwen3_30b.write_random_checkpoint(folder)
        print(f"[noise_modes] wrote {folder} in {time.perf_counter() - t0:.0f} s", flush=True)
    else:
        path = models.resolve_model(cfg.model)
    rows = []
    for noise in settings.NOISE_MODES:
        rows.append(measure(cli.parse_config(["--preset=smoke", *overrides, f"--noise={noise}"]), path,
                            opts["repeats"], opts["population"]))
        print(f"[noise_modes] {rows[-1]}", flush=True)
    print(f"{'noise':<12} {'params/rank':>12} {'perturb+restore s':>18} {'update s':>9} {'digest s':>9} {'layout s':>9}")
    for r in rows:
        print(f"{r['noise']:<12} {r['params_per_rank']:>12,} {r['perturb_restore_s']:>18} "
              f"{r['update_s']:>9} {r['digest_s']:>9} {r['first_digest_s']:>9}")
    model = f"Qwen3-30B-A3B layout cut to {opts['layers']} layers, random weights" if opts["qwen3_30b"] else cfg.model
    return emit({"bench": "noise_modes", "date": time.strftime("%Y-%m-%d"), "model": model,
                 "update_members": opts["population"],
                 "tensor_parallel_size": cfg.tensor_parallel_size, "device": vllm_platform.device_type(), "rows": rows},
                opts["out"])


if __name__ == "__main__":
    print_until_reader_gone()
    prepare_script()
    main(sys.argv[1:])
