"""What checkpoint noise costs: perturb, restore, an N-member update and the digest per noise mode, on one model.

The rank-salted noise draws torch.randn per (member, rank, parameter); the checkpoint noise computes each element's
normal from a counter hash with integer and IEEE basic operations (about 60 elementwise kernels per chunk) and
reads the runtime-to-checkpoint layout. Prints a table and one JSON line (also written to --out).

    python bench/noise_modes.py --model=smollm2-135m --out=bench/results/noise_modes_cpu.json   # CPU, TP=2
"""

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[0]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common as C  # noqa: E402
from report import emit  # noqa: E402


def seconds_of(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(cfg, repeats: int, population: int) -> dict:
    path = C.resolve_model(cfg.model)
    with C.Engine(cfg, path) as engine:
        t0 = time.perf_counter()
        engine.digests()  # the first call derives the checkpoint layout (checkpoint noise)
        first_digest = time.perf_counter() - t0
        seeds = C.member_seeds(cfg.run_seed, 0, population)
        coeffs = C.update_coefficients(C.zscore(list(range(population))), cfg.alpha)
        return {
            "noise": cfg.noise,
            "params_per_rank": sum(r["params"] for r in engine.rpc("es_memory")) // cfg.tensor_parallel_size,
            "first_digest_s": round(first_digest, 3),
            "perturb_restore_s": round(seconds_of(lambda: (engine.perturb(seeds[0], cfg.sigma_start), engine.restore()),
                                          repeats), 3),
            "update_s": round(seconds_of(lambda: engine.update(seeds, coeffs), 1), 3),
            "digest_s": round(seconds_of(engine.digests, repeats), 3),
        }


def main(argv):
    opts, overrides = C.parse_args(argv, {"out": "", "repeats": 3, "population": 8})
    rows = []
    for noise in C.NOISE_MODES:
        cfg = C.parse_config(["--preset=smoke", *overrides, f"--noise={noise}"])
        rows.append(measure(cfg, opts["repeats"], opts["population"]))
    print(f"{'noise':<12} {'params/rank':>12} {'perturb+restore s':>18} {'update s':>9} {'digest s':>9} {'layout s':>9}")
    for r in rows:
        print(f"{r['noise']:<12} {r['params_per_rank']:>12,} {r['perturb_restore_s']:>18} "
              f"{r['update_s']:>9} {r['digest_s']:>9} {r['first_digest_s']:>9}")
    return emit({"bench": "noise_modes", "date": time.strftime("%Y-%m-%d"), "model": cfg.model,
                 "update_members": opts["population"],
                 "tensor_parallel_size": cfg.tensor_parallel_size, "device": C.device_type(), "rows": rows},
                opts["out"])


if __name__ == "__main__":
    C.prepare_script()
    main(sys.argv[1:])
