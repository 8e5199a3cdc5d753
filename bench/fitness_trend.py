"""How fast did training fitness rise, and how long did a generation take? The least-squares slope of the mean
member fitness per generation, with a 95% percentile-bootstrap interval over generations, for each ES history given,
beside its alpha and mean sigma; and the seconds per generation from the history's own timings (the members' phase,
the update and the digest: a generation's wall time but its writes), median and range over generations
--timed_from=k and later (the first ones of a history can have shared the machine with other work).

    python bench/fitness_trend.py bench/results/learning_gpu_clean_seed20260627_history.json ... --out=trend.json

With --match=REFERENCE.json[,...] it also gives, for each history, the generations it needs at its own slope to gain
the training fitness the reference runs gained over theirs (their mean of slope x generations), with a 95% interval
from both bootstraps; an interval of this run's slope that reaches 0 leaves the upper bound open.

Why alpha x sigma is printed: the update is alpha/N * sum_i z_i eps_i, and the part of a member's z-score that its
perturbation explains (rather than sampling) grows with sigma, so the expected fitness gain of one update grows
about as alpha x sigma. The ratio of two runs' slopes can then be read against the ratio of their alpha x sigma.
"""

import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import common  # noqa: E402
from agentic_es import cli, fileio  # noqa: E402
from report import emit, print_until_reader_gone  # noqa: E402

BOOTSTRAP = 10_000


def mean_fitness(history: dict) -> np.ndarray:
    return np.array([np.mean(g["rewards"]) for g in history["generations"]])


def slopes(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least-squares slopes of y on x along the last axis (one per row): cov(x, y) / var(x)."""
    xc = x - x.mean(axis=-1, keepdims=True)
    return (xc * (y - y.mean(axis=-1, keepdims=True))).sum(axis=-1) / (xc * xc).sum(axis=-1)


def slope_draws(history: dict, seed: int = 0) -> tuple[float, np.ndarray]:
    """The slope of the mean member fitness per generation, and its bootstrap draws (resampling generations)."""
    y = mean_fitness(history)
    x = np.arange(len(y), dtype=float)
    if len(y) < 3:
        raise ValueError(f"a trend needs at least 3 generations, the history has {len(y)}")
    idx = np.random.default_rng(seed).integers(0, len(y), size=(BOOTSTRAP, len(y)))
    idx = idx[np.ptp(idx, axis=1) > 0]  # a resample of one repeated generation has no slope
    return float(slopes(x, y)), slopes(x[idx], y[idx])


def fitness_trend(history: dict, seed: int = 0) -> dict:
    """Slope of the mean member fitness per generation and its 95% bootstrap interval (resampling generations)."""
    y = mean_fitness(history)
    slope, boots = slope_draws(history, seed)
    gens = history["generations"]
    alpha, sigma = gens[0]["alpha"], float(np.mean([g["sigma"] for g in gens]))
    return {"generations": len(y), "alpha": alpha, "mean_sigma": sigma, "alpha_x_sigma": alpha * sigma,
            "slope_per_generation": slope, "ci_low": float(np.percentile(boots, 2.5)),
            "ci_high": float(np.percentile(boots, 97.5)),
            "first_half_mean": float(y[: len(y) // 2].mean()), "second_half_mean": float(y[len(y) // 2:].mean()),
            "within_generation_std": float(np.mean([np.std(g["rewards"]) for g in gens]))}


def reference_gain(references: list[dict], seed: int = 1) -> tuple[float, np.ndarray]:
    """The training fitness the reference runs gained over their generations (the mean of their slope x
    generations), and its bootstrap draws."""
    ref = [slope_draws(h, seed + i) for i, h in enumerate(references)]
    n = min(len(d) for _, d in ref)
    gain = float(np.mean([s * len(h["generations"]) for (s, _), h in zip(ref, references)]))
    if gain <= 0:
        raise ValueError(f"the reference runs gained no training fitness ({gain:+.4f}): there is nothing to match")
    return gain, np.mean([d[:n] * len(h["generations"]) for (_, d), h in zip(ref, references)], axis=0)


def generations_to_match(history: dict, reference: tuple[float, np.ndarray], seed: int = 0) -> dict:
    """Generations this run needs, at its own slope, to gain the references' training fitness (`reference_gain`):
    the point value and a 95% interval from the bootstrap draws of both, taken on the gain per generation and
    inverted; a bound past a non-positive rate is open (None)."""
    gain, gain_draws = reference
    slope, draws = slope_draws(history, seed)
    n = min(len(gain_draws), len(draws))
    low, high = np.percentile(draws[:n] / gain_draws[:n], [2.5, 97.5])  # the share of the gain per generation

    def generations(rate):
        return float(1 / rate) if rate > 0 else None

    return {"reference_gain": gain, "match_generations": generations(slope / gain),
            "match_ci_low": generations(high), "match_ci_high": generations(low)}


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


def count(generations: float | None) -> str:
    return "open" if generations is None else f"{generations:.0f}"


def main(argv):
    paths = [a for a in argv if not a.startswith("--")]
    opts, _ = cli.parse_args([a for a in argv if a.startswith("--")], {"out": "", "timed_from": 0, "match": ""})
    if not paths:
        sys.exit("usage: python bench/fitness_trend.py HISTORY.json ... [--timed_from=K] [--match=REF.json,...] "
                 "[--out=FILE]")
    histories = [(p, fileio.read_json(Path(p))) for p in paths]
    references = [p for p in opts["match"].split(",") if p]
    reference = reference_gain([fileio.read_json(Path(p)) for p in references]) if references else None
    rows = [dict(history=p, **fitness_trend(h), **generation_seconds(h, opts["timed_from"]),
                 **(generations_to_match(h, reference) if references else {})) for p, h in histories]
    print(f"{'history':<58} {'gens':>4} {'alpha x sigma':>13} {'slope / generation [95% CI]':>34} "
          f"{'s / generation [range]':>24} {'ES ops s':>8}" + ("  generations to match [95% CI]" if references else ""))
    for r in rows:
        timing = (f"{r['seconds_per_generation']:6.1f} [{r['seconds_min']:.1f}, {r['seconds_max']:.1f}]"
                  if r["timed_generations"] else "-")
        match = (f"  {count(r['match_generations'])} [{count(r['match_ci_low'])}, {count(r['match_ci_high'])}]"
                 if references else "")
        print(f"{Path(r['history']).name:<58} {r['generations']:>4} {r['alpha_x_sigma']:>13.2e} "
              f"{r['slope_per_generation']:+.5f} [{r['ci_low']:+.5f}, {r['ci_high']:+.5f}] {timing:>24} "
              f"{r.get('es_ops_seconds', float('nan')):8.2f}{match}")
    result = {"bench": "fitness_trend", "runs": rows}
    if references:
        result["match_references"] = references
    return emit(result, opts["out"])


if __name__ == "__main__":
    print_until_reader_gone()
    main(sys.argv[1:])
