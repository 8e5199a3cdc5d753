"""Base vs trained on the held-out set of a run through the four scripts: the strict agent score's Mean4 and Pass4
(03_eval.py's reported group, samples 12-15) and mean@16, each with a 95% percentile-bootstrap interval over
problems, and the paired difference (trained - base: the same problems, sample indices and seeds) with its interval;
beside them the replay's agreement. Reads the files bench/learn_stages_h200.sh brings back (no engine; an
eval16 file may be gzip-compressed, FILE.gz):

    python bench/strict_stages_summary.py --trained=bench/results/strict_stages_seed1_eval16.json.gz \
        --base=bench/results/strict_stages_seed1_eval_base_eval16.json.gz \
        --replay=bench/results/strict_stages_seed1_replay.json --out=bench/results/strict_stages_seed1_summary.json
"""

import gzip
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[0]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from agentic_es import cli, fileio  # noqa: E402
from agentic_es.metrics import EVAL_SAMPLES, REPORTED_SAMPLES  # noqa: E402
from report import emit, print_until_reader_gone  # noqa: E402

OPTIONS = {"trained": "", "base": "", "replay": "", "out": "", "seed": 0}
BOOTSTRAP = 10_000
METRICS = {  # name -> per-problem value from a (problems x 16 samples) table of 0/1 strict scores
    "mean4": lambda s: s[:, list(REPORTED_SAMPLES)].mean(axis=1),  # Mean4 = the mean of these over problems
    "pass4": lambda s: s[:, list(REPORTED_SAMPLES)].max(axis=1),   # Pass4 = the mean of these over problems
    "mean_at_16": lambda s: s.mean(axis=1),
}


def score_table(records: list[dict], problem_ids: list) -> np.ndarray:
    """(problems x EVAL_SAMPLES) strict scores (the agent's score, 0/1) in problem_ids' order."""
    table = {}
    for r in records:
        table.setdefault(r["problem_id"], {})[r["sample_index"]] = float(r["score"])
    missing = [(p, i) for p in problem_ids for i in range(EVAL_SAMPLES) if i not in table.get(p, {})]
    if missing:
        raise ValueError(f"{len(missing)} (problem, sample) episodes missing, e.g. {missing[0]}")
    return np.array([[table[p][i] for i in range(EVAL_SAMPLES)] for p in problem_ids])


def read_json(path: str):
    """A JSON file, gzip-compressed where its name ends in .gz (bench/results keeps the eval16 files so)."""
    if path.endswith(".gz"):
        with gzip.open(path, "rt", encoding="utf-8") as f:
            return json.load(f)
    return fileio.read_json(path)


def interval(values: np.ndarray, idx: np.ndarray) -> dict:
    means = values[idx].mean(axis=1)
    return {"mean": float(values.mean()), "ci_low": float(np.percentile(means, 2.5)),
            "ci_high": float(np.percentile(means, 97.5))}


def compare(base: np.ndarray, trained: np.ndarray, seed: int = 0) -> dict:
    """Each metric: base and trained with their intervals, and the paired difference's (one set of resampled
    problem indices for all three, so the difference's interval is the paired one)."""
    idx = np.random.default_rng(seed).integers(0, len(base), size=(BOOTSTRAP, len(base)))
    out = {}
    for name, per_problem in METRICS.items():
        b, t = per_problem(base), per_problem(trained)
        out[name] = {"base": interval(b, idx), "trained": interval(t, idx), "difference": interval(t - b, idx)}
        d = out[name]["difference"]
        out[name]["verdict"] = ("trained above base (interval above 0)" if d["ci_low"] > 0 else
                                "trained below base (interval below 0)" if d["ci_high"] < 0 else
                                "no difference shown (interval holds 0)")
    return out


def replay_agreement(path: str) -> dict:
    """04_replay.py's report in short: per set its agreement with the evaluation, and the generations replayed."""
    replay = fileio.read_json(path)
    report = {name: {k: d.get(k) for k in ("sample_agreement", "identical_transcripts", "problems_fully_agreeing")}
              for name, d in replay["datasets"].items()}
    report["replayed_generations"] = replay.get("replayed_generations")
    return report


def main(argv: list[str]) -> dict:
    opts, rest = cli.parse_args(argv, OPTIONS)
    if rest or not opts["trained"] or not opts["base"]:
        raise SystemExit(f"usage: --trained=EVAL16 --base=EVAL16 [--replay=REPORT] [--out=FILE]; got {rest}")
    trained, base = read_json(opts["trained"]), read_json(opts["base"])
    problem_ids = sorted({r["problem_id"] for r in base["records"]}, key=str)
    if problem_ids != sorted({r["problem_id"] for r in trained["records"]}, key=str):
        raise ValueError("the two evaluations hold different problems")
    if base.get("data_sha256") != trained.get("data_sha256"):
        raise ValueError("the two evaluations read different data")
    report = {"bench": "strict_stages_summary", "trained": opts["trained"], "base": opts["base"],
              "problems": len(problem_ids), "samples": EVAL_SAMPLES, "reported_samples": list(REPORTED_SAMPLES),
              "ci": f"95% percentile bootstrap over problems, {BOOTSTRAP} resamples, paired",
              "trained_checkpoint": {k: trained["checkpoint"].get(k) for k in ("kind", "replayed_generations")},
              "metrics": compare(score_table(base["records"], problem_ids),
                                 score_table(trained["records"], problem_ids), opts["seed"])}
    if opts["replay"]:
        report["replay"] = replay_agreement(opts["replay"])
    for name, m in report["metrics"].items():
        print(f"{name:10s} base {m['base']['mean']:.3f} [{m['base']['ci_low']:.3f}, {m['base']['ci_high']:.3f}]  "
              f"trained {m['trained']['mean']:.3f} [{m['trained']['ci_low']:.3f}, {m['trained']['ci_high']:.3f}]  "
              f"difference {m['difference']['mean']:+.3f} [{m['difference']['ci_low']:+.3f}, "
              f"{m['difference']['ci_high']:+.3f}]: {m['verdict']}")
    return emit(report, opts["out"])


if __name__ == "__main__":
    print_until_reader_gone()
    main(sys.argv[1:])
