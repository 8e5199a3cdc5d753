"""The scorer's speed: answers per second through the scorer worker pool (scoring.score_answer_isolated, as the
episode loop scores), on held-out-style answers: each gold of the DAPO-100 held-out set (--data) written in the forms
a model answers in (FORMS: a box after the marker, a plain number, notes, digit groups, a box without a marker,
fractions and powers that math-verify decides, a wrong value, a hedge), read by extract_final_answer in this process
first, as the episode loop reads them. Also, per second, that reading alone and score_answer in this process alone;
and per form the mean score and the score methods, so that two scorers' runs show what each one reads.

--scoring=DIR takes scoring.py from DIR instead of this checkout (it imports nothing of the project), to compare two
versions on the same machine:

    bash run_cpu.sh python bench/scorer_speed.py --out=bench/results/scorer_speed_cpu.json
    mkdir -p /tmp/scoring_2ec1038 && git show 2ec1038:scoring.py > /tmp/scoring_2ec1038/scoring.py
    bash run_cpu.sh python bench/scorer_speed.py --scoring=/tmp/scoring_2ec1038 --out=scorer_speed_2ec1038.json

Prints one JSON line and a table.
"""

import asyncio
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from report import emit, print_until_reader_gone  # noqa: E402

DATA = "../shared/data/dapo_test100.jsonl"  # held-out problems with integer golds (relative to the repository root)
REPEATS = 3  # timed passes of every answer through the pool; the median is reported
PROCESSES = 4  # scorer workers (scoring.SCORER_PROCESSES, the episode loop's default)
FORMS = {  # name: the reply, from the gold g and a wrong value w
    "box after the marker": "It prints {g}.\nFinal answer: \\boxed{{{g}}}",
    "markdown, box in $": "**Final Answer:** $\\boxed{{{g}}}$",
    "plain number": "Final answer: {g}",
    "note after the box": "Final answer: \\boxed{{{g}}} (verified with the script)",
    "note after the number": "Final answer: {g} - checked by brute force over n = 1..100",
    "box without a marker": "Counting them all, the answer is \\boxed{{{g}}}.",
    "digit groups": "Final answer: {g:,}",
    "a name =": "Final answer: x = {g}",
    "fraction": "Final answer: \\boxed{{\\frac{{{g2}}}{{2}}}}",
    "root (math-verify)": "Final answer: \\boxed{{\\sqrt{{{gg}}}}}",
    "power (math-verify)": "Final answer: \\boxed{{{g}^{{1}}}}",
    "wrong value": "Final answer: \\boxed{{{w}}}",
    "hedge": "Final answer: \\boxed{{{g}}} or \\boxed{{{w}}}",
}


def options(argv):
    opts = {"data": DATA, "scoring": "", "repeats": REPEATS, "processes": PROCESSES, "out": ""}
    for arg in argv:
        key, _, value = arg.removeprefix("--").partition("=")
        if key not in opts or not value:
            sys.exit(f"usage: python bench/scorer_speed.py [--{'=... [--'.join(opts)}=...]; got {arg!r}")
        opts[key] = type(opts[key])(value)
    return opts


def answers(data_path):
    """(form, reply, gold) for every gold of the data file in every form."""
    golds = [json.loads(line)["answer"] for line in Path(data_path).read_text().splitlines() if line.strip()]
    return [(form, text.format(g=int(g), g2=2 * int(g), gg=int(g) ** 2, w=int(g) + 1), g)
            for g in golds for form, text in FORMS.items()]


async def through_the_pool(scoring, pairs):
    return await asyncio.gather(*(scoring.score_answer_isolated(prediction, gold) for prediction, gold in pairs))


def per_second(count, seconds):
    return round(count / seconds, 1)


def scoring_module(folder: str):
    """agentic_es.scoring of this checkout, or the scoring.py in `folder` (another version's, by its file)."""
    if not folder:
        sys.path.insert(0, str(REPO))
        from agentic_es import scoring
        return scoring
    spec = importlib.util.spec_from_file_location("scoring", Path(folder).resolve() / "scoring.py")
    scoring = importlib.util.module_from_spec(spec)
    sys.modules["scoring"] = scoring  # its worker processes run the same file by path
    spec.loader.exec_module(scoring)
    return scoring


def main(argv):
    opts = options(argv)
    scoring = scoring_module(opts["scoring"])

    cases = answers(REPO / opts["data"] if not Path(opts["data"]).is_absolute() else opts["data"])
    started = time.perf_counter()
    predictions = [scoring.extract_final_answer(reply) for _, reply, _ in cases]
    read_seconds = time.perf_counter() - started
    pairs = [(prediction, gold) for prediction, (_, _, gold) in zip(predictions, cases)]
    in_process = [scoring.score_answer(*pair) for pair in pairs]  # warm: math_verify and sympy imported here
    started = time.perf_counter()
    in_process = [scoring.score_answer(*pair) for pair in pairs]
    score_seconds = time.perf_counter() - started

    scoring.SCORER_PROCESSES = opts["processes"]
    scoring.shutdown_scorer_pool()
    try:
        asyncio.run(through_the_pool(scoring, pairs[:opts["processes"]]))  # every worker started and ready
        pool_seconds = []
        for _ in range(opts["repeats"]):
            started = time.perf_counter()
            pooled = asyncio.run(through_the_pool(scoring, pairs))
            pool_seconds.append(time.perf_counter() - started)
    finally:
        scoring.shutdown_scorer_pool()
    forms = {}
    for (form, _, _), (score, method) in zip(cases, pooled):
        entry = forms.setdefault(form, {"answers": 0, "score": 0.0, "methods": {}})
        entry["answers"] += 1
        entry["score"] += score
        entry["methods"][method] = entry["methods"].get(method, 0) + 1
    for entry in forms.values():
        entry["score"] = round(entry["score"] / entry["answers"], 3)

    result = {"bench": "scorer_speed", "scoring": str(Path(scoring.__file__).resolve()), "answers": len(pairs),
              "processes": opts["processes"], "repeats": opts["repeats"],
              "pool_answers_per_s": per_second(len(pairs), statistics.median(pool_seconds)),
              "pool_answers_per_s_each": [per_second(len(pairs), s) for s in pool_seconds],
              "read_answers_per_s": per_second(len(pairs), read_seconds),
              "score_answers_per_s_in_process": per_second(len(pairs), score_seconds),
              "pool_agrees_with_in_process": pooled == in_process, "forms": forms}
    print(f"{'scorer':<31} {result['scoring']}\n{'answers':<31} {len(pairs)} ({len(FORMS)} forms of each gold)")
    for key in ("pool_answers_per_s", "pool_answers_per_s_each", "read_answers_per_s",
                "score_answers_per_s_in_process", "pool_agrees_with_in_process"):
        print(f"{key:<31} {result[key]}")
    print(f"\n{'form':<26} {'score':>5}  methods")
    for form, entry in forms.items():
        methods = ", ".join(f"{method} {n}" for method, n in sorted(entry["methods"].items()))
        print(f"{form:<26} {entry['score']:>5.2f}  {methods}")
    return emit(result, opts["out"])


if __name__ == "__main__":
    print_until_reader_gone()
    main(sys.argv[1:])
