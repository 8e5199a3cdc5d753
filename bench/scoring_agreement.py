"""The scorer against independent graders: how many replies of a held-out batch the production path
(extract_final_answer, then score_answer) scores otherwise than a careful competition grader did. Each batch is a
JSONL file of {"reply", "gold", "expected", "why"}: the end of an agent's final reply, written by a reviewer who had
not read the scorer, its tests or docs/scoring.md (bench/results/scoring_heldout_*.jsonl, bench/README.md).

    bash run_cpu.sh python bench/scoring_agreement.py bench/results/scoring_heldout_*.jsonl

Prints each disagreement, a table (batch, cases, off) and one JSON line.
"""

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
from report import emit, print_until_reader_gone  # noqa: E402

from agentic_es import scoring  # noqa: E402


def disagreements(path):
    """(cases, the rows scored otherwise than expected, each with the prediction, score and method)."""
    rows = [json.loads(line) for line in Path(path).open(encoding="utf-8")]
    off = []
    for row in rows:
        prediction = scoring.extract_final_answer(row["reply"])
        score, method = scoring.score_answer(prediction, row["gold"])
        if int(score) != row["expected"]:
            off.append({**row, "prediction": prediction, "score": score, "method": method})
    return len(rows), off


def main(paths):
    if not paths:
        sys.exit("usage: python bench/scoring_agreement.py BATCH.jsonl [BATCH.jsonl ...]")
    batches = {}
    for path in paths:
        cases, off = disagreements(path)
        for row in off:
            print(json.dumps(row, ensure_ascii=False))
        batches[Path(path).name] = {"cases": cases, "off": len(off)}
    print(f"\n{'batch':34} {'cases':>6} {'off':>4}")
    for name, batch in batches.items():
        print(f"{name:34} {batch['cases']:>6} {batch['off']:>4}")
    return emit({"bench": "scoring_agreement", "batches": batches,
                 "cases": sum(b["cases"] for b in batches.values()), "off": sum(b["off"] for b in batches.values())})


if __name__ == "__main__":
    print_until_reader_gone()
    main(sys.argv[1:])
