"""What an agent did in its episodes, read from their transcripts (03_eval.py's <set>_episodes.jsonl, or
bench/strict_base.py's --episodes file; plain or gzip-compressed): the protocol failures ES can lift first, and
whether its bash commands compute something from the problem.

    python bench/agent_behaviour.py runs/compute/eval/compute_heldout_episodes.jsonl [MORE.jsonl.gz ...]

Per episode (`behaviour`):
- never_bash: no bash call in the whole episode (the model answered from its head and repeated it after each
  refusal, or never replied with an action);
- bash_and_answer: some reply holds a bash call and a final answer at once (the loop runs the command and
  ignores the answer, which was written before the output was seen);
- example_only: every command it ran is the system prompt's example or its template (common.SYSTEM_PROMPT);
- from_problem: some command uses a number of the problem (below), and is not the example;
- junk: it called bash, but no command uses the problem's numbers and not all are the example (`bash`, `ls`,
  `echo 42`, a guess printed back).
A command uses the problem where it holds one of the numbers written in the problem (its statement without
DAPO's "Answer:" instructions) of two digits or more; where the problem has none, any of its numbers. This is a
floor, not a judge of the program: `python3 -c 'print(2**10)'` for "2^{10}" counts, `print(1024)` does not.
"""

import collections
import gzip
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
from agentic_es import actions, scoring  # noqa: E402

# the system prompt's two commands: the action's template ("<shell command>") and its worked example
EXAMPLE_COMMANDS = {actions.parse_action(common.SYSTEM_PROMPT),
                    actions.parse_action(common.SYSTEM_PROMPT.split("for example", 1)[1])}
# DAPO's instructions around the statement (the compute task's wording copies them): not the problem's numbers
_INSTRUCTIONS = re.compile(r"Solve the following math problem step by step\..*?answer to the problem\.|"
                           r"Remember to put your answer on its own line after \"Answer:\"\.", re.S)
_NUMBER = re.compile(r"(?<![\w.])\d+(?![\d])")
KINDS = ("never_bash", "bash_and_answer", "example_only", "from_problem", "junk")


def read_episodes(path) -> list[dict]:
    """Records of a JSONL file (gzip-compressed where its name ends in .gz) that hold their conversation."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def problem_text(record: dict) -> str:
    """The problem's statement: the first user message less the agent's and DAPO's instructions."""
    user = next(m["content"] for m in record["messages"] if m["role"] == "user")
    statement = user.split("Problem:\n", 1)[-1].split("\n\nSolve the problem.", 1)[0]
    return _INSTRUCTIONS.sub("", statement)


def problem_numbers(text: str) -> set[str]:
    numbers = {n.lstrip("0") or "0" for n in _NUMBER.findall(text)}
    long = {n for n in numbers if len(n) >= 2}
    return long or numbers


def commands(record: dict) -> list[str]:
    return [c for m in record["messages"] if m["role"] == "assistant" and (c := actions.parse_action(m["content"]))]


def uses_problem(command: str, numbers: set[str]) -> bool:
    found = {n.lstrip("0") or "0" for n in _NUMBER.findall(command)}
    return not is_example(command) and bool(found & numbers)


def is_example(command: str) -> bool:
    return command.strip() in EXAMPLE_COMMANDS


def behaviour(record: dict) -> dict:
    """The episode's kinds (KINDS): each a bool; from_problem, example_only and junk exclude one another."""
    ran = commands(record)
    numbers = problem_numbers(problem_text(record))
    replies = [m["content"] for m in record["messages"] if m["role"] == "assistant"]
    from_problem = any(uses_problem(c, numbers) for c in ran)
    example_only = bool(ran) and all(is_example(c) for c in ran)
    return {"never_bash": not ran,
            "bash_and_answer": any(actions.parse_action(r) and scoring.extract_final_answer(r) for r in replies),
            "example_only": example_only, "from_problem": from_problem,
            "junk": bool(ran) and not from_problem and not example_only}


def summary(records: list[dict]) -> dict:
    """Counts of each kind, with the scores, turns, generated tokens and ends of the episodes."""
    kinds = collections.Counter()
    for r in records:
        kinds.update(k for k, v in behaviour(r).items() if v)
    n = len(records)
    return {"episodes": n, "score": sum(r["score"] for r in records) / max(n, 1),
            "counts": {k: kinds[k] for k in KINDS},
            "shares": {k: kinds[k] / max(n, 1) for k in KINDS},
            "turns_per_episode": sum(r["turns"] for r in records) / max(n, 1),
            "completion_tokens_per_episode": sum(r["completion_tokens"] for r in records) / max(n, 1),
            "finish": dict(collections.Counter(r["finish_reason"] for r in records))}


def main(argv: list[str]) -> dict:
    if not argv:
        raise SystemExit(__doc__)
    report = {}
    for path in argv:
        report[path] = s = summary(read_episodes(path))
        print(f"{path}: {s['episodes']} episodes, score {s['score']:.3f}, " +
              ", ".join(f"{k} {s['counts'][k]}" for k in KINDS) +
              f"; {s['turns_per_episode']:.2f} turns, {s['completion_tokens_per_episode']:.0f} tokens per episode")
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
