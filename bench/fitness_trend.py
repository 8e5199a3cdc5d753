"""How fast did training fitness rise, and how long did a generation take? The least-squares slope of the mean
member fitness per generation, with a 95% percentile-bootstrap interval over generations, for each ES history given,
beside its alpha and mean sigma; and the seconds per generation from the history's own timings (the members' phase,
the update and the digest: a generation's wall time but its writes), median and range over generations
--timed_from=k and later (the first ones of a history can have shared the machine with other work).

    python bench/fitness_trend.py bench/results/learning_gpu_clean_seed20260627_history.json ... --out=trend.json

Why alpha x sigma is printed: the update is alpha/N * sum_i z_i eps_i, and the part of a member's z-score that its
perturbation explains (rather than sampling) grows with sigma, so the expected fitness gain of one update grows
about as alpha x sigma. The ratio of two runs' slopes can then be read against the ratio of their alpha x sigma.
"""

import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import common as C  # noqa: E402
from report import emit  # noqa: E402

BOOTSTRAP = 10_000


def mean_fitness(history: dict) -> np.ndarray:
    return np.array([np.mean(g["rewards"]) for g in history["generations"]])


def slopes(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least-squares slopes of y on x along the last axis (one per row): cov(x, y) / var(x)."""
    xc = x - x.mean(axis=-1, keepdims=True)
    return (xc * (y - y.mean(axis=-1, keepdims=True))).sum(axis=-1) / (xc * xc).sum(axis=-1)


def fitness_trend(history: dict, seed: int = 0) -> dict:
    """Slope of the mean member fitness per generation and its 95% bootstrap interval (resampling generations)."""
    y = mean_fitness(history)
    x = np.arange(len(y), dtype=float)
    if len(y) < 3:
        raise ValueError(f"a trend needs at least 3 generations, the history has {len(y)}")
    idx = np.random.default_rng(seed).integers(0, len(y), size=(BOOTSTRAP, len(y)))
    idx = idx[np.ptp(idx, axis=1) > 0]  # a resample of one repeated generation has no slope
    boots = slopes(x[idx], y[idx])
    gens = history["generations"]
    alpha, sigma = gens[0]["alpha"], float(np.mean([g["sigma"] for g in gens]))
    return {"generations": len(y), "alpha": alpha, "mean_sigma": sigma, "alpha_x_sigma": alpha * sigma,
            "slope_per_generation": float(slopes(x, y)), "ci_low": float(np.percentile(boots, 2.5)),
            "ci_high": float(np.percentile(boots, 97.5)),
            "first_half_mean": float(y[: len(y) // 2].mean()), "second_half_mean": float(y[len(y) // 2:].mean()),
            "within_generation_std": float(np.mean([np.std(g["rewards"]) for g in gens]))}


def seconds_of(generation: dict) -> float:
    """A generation's wall time but its writes: the members' phase, the update and the digest, as recorded."""
    return sum(generation["timings"].get(k, 0.0) for k in ("members", "update", "digest"))


def generation_seconds(history: dict, timed_from: int = 0) -> dict:
    """Seconds per generation (members + update + digest, from each generation's recorded timings) over the
    generations numbered timed_from and later, and the ES operations' share of them (perturb + restore + update)."""
    gens = [g for g in history["generations"] if g.get("timings") and g["generation"] >= timed_from]
    if not gens:
        return {"timed_generations": 0}
    total = np.array([seconds_of(g) for g in gens])
    es_ops = np.array([g["timings"]["perturb"] + g["timings"]["restore"] + g["timings"]["update"] for g in gens])
    return {"timed_generations": len(gens), "seconds_per_generation": float(np.median(total)),
            "seconds_min": float(total.min()), "seconds_max": float(total.max()),
            "es_ops_seconds": float(np.median(es_ops))}


def main(argv):
    paths = [a for a in argv if not a.startswith("--")]
    opts, _ = C.parse_args([a for a in argv if a.startswith("--")], {"out": "", "timed_from": 0})
    if not paths:
        sys.exit("usage: python bench/fitness_trend.py HISTORY.json ... [--out=FILE]")
    histories = [(p, C.read_json(Path(p))) for p in paths]
    rows = [dict(history=p, **fitness_trend(h), **generation_seconds(h, opts["timed_from"])) for p, h in histories]
    print(f"{'history':<58} {'gens':>4} {'alpha x sigma':>13} {'slope / generation [95% CI]':>34} "
          f"{'s / generation [range]':>24} {'ES ops s':>8}")
    for r in rows:
        timing = (f"{r['seconds_per_generation']:6.1f} [{r['seconds_min']:.1f}, {r['seconds_max']:.1f}]"
                  if r["timed_generations"] else "-")
        print(f"{Path(r['history']).name:<58} {r['generations']:>4} {r['alpha_x_sigma']:>13.2e} "
              f"{r['slope_per_generation']:+.5f} [{r['ci_low']:+.5f}, {r['ci_high']:+.5f}] {timing:>24} "
              f"{r.get('es_ops_seconds', float('nan')):8.2f}")
    return emit({"bench": "fitness_trend", "runs": rows}, opts["out"])


if __name__ == "__main__":
    main(sys.argv[1:])
