"""bench/strict_stages_summary.py: base vs trained Mean4 / Pass4 / mean@16 from two eval16 files, each with a
bootstrap interval over problems, and the paired difference's interval."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import strict_stages_summary as summary  # noqa: E402


def eval16(path: Path, scores: dict) -> str:
    records = [{"problem_id": pid, "sample_index": i, "seed": i, "score": s} for pid, row in scores.items()
               for i, s in enumerate(row)]
    path.write_text(json.dumps({"records": records, "data_sha256": {"learn_heldout": "x"},
                                "checkpoint": {"kind": "base"}}))
    return str(path)


def test_mean4_pass4_mean16_and_the_paired_difference(tmp_path, capsys):
    base = {"p0": [0] * 12 + [1, 0, 0, 0], "p1": [0] * 16}           # Mean4 1/8, Pass4 1/2, mean@16 1/32
    trained = {"p0": [1] * 16, "p1": [1] * 12 + [1, 1, 0, 0]}        # Mean4 6/8, Pass4 1, mean@16 30/32
    report = summary.main([f"--base={eval16(tmp_path / 'b.json', base)}",
                           f"--trained={eval16(tmp_path / 't.json', trained)}", f"--out={tmp_path / 's.json'}"])
    m = report["metrics"]
    assert m["mean4"]["base"]["mean"] == 1 / 8 and m["mean4"]["trained"]["mean"] == 6 / 8
    assert m["pass4"]["base"]["mean"] == 1 / 2 and m["pass4"]["trained"]["mean"] == 1
    assert m["mean_at_16"]["difference"]["mean"] == pytest.approx(30 / 32 - 1 / 32)
    d = m["mean4"]["difference"]
    assert d["mean"] == 5 / 8 and 0 < d["ci_low"] <= d["mean"] <= d["ci_high"] <= 1
    assert m["mean4"]["verdict"].startswith("trained above base")
    assert json.loads((tmp_path / "s.json").read_text())["problems"] == 2


def test_a_missing_episode_is_refused():
    with pytest.raises(ValueError, match="missing"):
        summary.score_table([{"problem_id": "p0", "sample_index": 0, "score": 1}], ["p0"])


def test_no_difference_when_both_are_equal():
    table = np.array([[1, 0] * 8, [0, 1] * 8], dtype=float)
    m = summary.compare(table, table)
    assert all(v["difference"]["mean"] == 0 and v["verdict"].startswith("no difference") for v in m.values())


def test_the_difference_s_interval_is_the_paired_resample_s_where_an_unpaired_one_would_hold_0():
    """40 problems of every difficulty, the trained model 1 sample of 4 better on 8 of them: resampling the problems
    once for both models (paired) the difference's interval lies above 0; resampling each model's problems apart
    (unpaired) it holds 0, the spread between problems swamping the gain. The interval reported is the 2.5th and
    97.5th percentiles of the paired resample's mean differences."""
    levels = [0, 1, 2, 3, 4] * 8  # samples 12-15 solved, per problem: Mean4 0 .. 1
    better = {i for i, level in enumerate(levels) if level < 4}
    better = set(sorted(better)[:8])
    base = np.zeros((40, 16))
    trained = np.zeros((40, 16))
    for i, level in enumerate(levels):
        base[i, 12:12 + level] = 1
        trained[i, 12:12 + level + (i in better)] = 1
    d = summary.compare(base, trained)["mean4"]["difference"]
    assert d["mean"] == pytest.approx(8 * 0.25 / 40) and d["ci_low"] > 0

    b, t = summary.METRICS["mean4"](base), summary.METRICS["mean4"](trained)
    idx = np.random.default_rng(0).integers(0, 40, size=(summary.BOOTSTRAP, 40))
    paired = (t - b)[idx].mean(axis=1)
    assert (d["ci_low"], d["ci_high"]) == (np.percentile(paired, 2.5), np.percentile(paired, 97.5))
    apart = np.random.default_rng(1).integers(0, 40, size=(summary.BOOTSTRAP, 40))
    unpaired = t[idx].mean(axis=1) - b[apart].mean(axis=1)
    assert np.percentile(unpaired, 2.5) < 0 < np.percentile(unpaired, 97.5)
