"""The learn task: additions "What is 12 + 7?" whose question shows the tool call, of the numbers 2..19 or, as harder
tiers, of two D-digit numbers (Config.learn_digits), split once into training and held-out questions; and its shaped
reward (Config.fitness="shaped"), which reads the question's operands in the wording this module writes
(LEARN_QUESTION, learn_operands): change one, change the other. data.py selects the task's sets ("learn",
"learn_heldout"); common.py's fitness pays its reward. A leaf: it imports actions.py and stage.py only.
"""

from __future__ import annotations

import re

import numpy as np

from agentic_es import stage
from agentic_es.actions import parse_action

LEARN_PROBLEMS = 192  # training set of the learn preset: 324 questions less the 132 held out (learn_pairs)
LEARN_HELDOUT_PAIRS = 66  # unordered pairs of two different numbers held out, in both orders: 132 questions
LEARN_SPLIT_SEED = 0x5911  # which pairs are held out (fixed: every run and every held-out set agree)
LEARN_OPERANDS = (2, 19)  # sums the base SmolLM2-135M gets right sometimes, not always (bench/README.md)
LEARN_SEED_TAG = 0x1EA2  # keeps the learn problems' stream apart from other streams seeded by the run seed
# The question shows the tool call, which the base SmolLM2-135M otherwise rarely makes (bench/README.md)
LEARN_QUESTION = ("What is {a} + {b}? First call the tool: "
                  "{{\"name\": \"bash\", \"arguments\": {{\"command\": \"python3 -c 'print({a} + {b})'\"}}}}")
LEARN_TRAIN_SEED = 0  # the training set's order is the same for every run seed
LEARN_HELDOUT_SEED = 1  # the held-out set's order: 03_eval.py and bench/learning.py take its first questions
LEARN_DIGITS_MIN = 2  # the fewest operand digits of a tier (Config.learn_digits): one digit has too few pairs
SETS = {"learn": "train", "learn_heldout": "heldout"}  # data.TASKS: the sets of the task, by train_data name
EVAL_SETS = {"learn_heldout": "learn_heldout"}  # what 03_eval.py evaluates after a run on it: never trained on


def set_problems(split: str, run_seed: int, learn_digits: int = 0, compute_level: int = 1) -> list[dict]:
    """A set of SETS (data.problems_from): its split of the tier learn_digits, the same for every run seed."""
    return problems(split, learn_digits)


def problems(split: str, digits: int = 0) -> list[dict]:
    """The task's training set ("train": LEARN_PROBLEMS questions in one fixed order) or every held-out question
    ("heldout", in one fixed order: none shares its operands with a training question), of the tier `digits` (0: the
    numbers 2..19)."""
    if split == "train":
        return learn_problems(LEARN_PROBLEMS, seed=LEARN_TRAIN_SEED, digits=digits)
    return learn_problems(2 * LEARN_HELDOUT_PAIRS, seed=LEARN_HELDOUT_SEED, split="heldout", digits=digits)


def learn_pairs() -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The learn task's operand pairs (a, b), split once by unordered pair into training and held-out: no held-out
    question has the operands of a training question, in either order. Held out: LEARN_HELDOUT_PAIRS pairs of two
    different numbers, both orders; training: every other pair (192 questions)."""
    low, high = LEARN_OPERANDS
    distinct = [(a, b) for a in range(low, high + 1) for b in range(a + 1, high + 1)]
    order = np.random.default_rng([LEARN_SEED_TAG, LEARN_SPLIT_SEED]).permutation(len(distinct))
    held = {distinct[i] for i in order[:LEARN_HELDOUT_PAIRS]}
    ordered = [(a, b) for a in range(low, high + 1) for b in range(low, high + 1)]
    return ([p for p in ordered if (min(p), max(p)) not in held], [p for p in ordered if (min(p), max(p)) in held])


def learn_digit_pairs(digits: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The operand pairs of the learn task's tier of two `digits`-digit numbers, split as learn_pairs splits: drawn
    once from a fixed stream, each unordered pair at most once; the first LEARN_HELDOUT_PAIRS pairs of two different
    numbers are held out in both orders, the next LEARN_PROBLEMS pairs (in the order drawn) are for training."""
    if digits < LEARN_DIGITS_MIN:
        raise ValueError(f"a tier of the learn task has at least {LEARN_DIGITS_MIN} operand digits, got {digits}")
    rng = np.random.default_rng([LEARN_SEED_TAG, LEARN_SPLIT_SEED, digits])
    seen, held, train = set(), [], []
    while len(train) < LEARN_PROBLEMS:
        a, b = (int(x) for x in rng.integers(10 ** (digits - 1), 10 ** digits, size=2))
        if (min(a, b), max(a, b)) in seen:
            continue
        seen.add((min(a, b), max(a, b)))
        if len(held) < 2 * LEARN_HELDOUT_PAIRS and a != b:
            held += [(a, b), (b, a)]
        elif len(held) == 2 * LEARN_HELDOUT_PAIRS:
            train.append((a, b))
    return train, held


def learn_problems(n, seed, split="train", digits=0):
    """n additions ("What is 12 + 7?") of the learn task's training or held-out pairs (learn_pairs; with digits,
    learn_digit_pairs), in an order drawn from `seed`."""
    pairs = (learn_digit_pairs(digits) if digits else learn_pairs())[("train", "heldout").index(split)]
    if n > len(pairs):
        raise stage.DataError(f"{n} learn problems asked for, but the {split} split has only {len(pairs)} questions")
    rng = np.random.default_rng([LEARN_SEED_TAG, int(seed)])
    tag = "" if split == "train" else "heldout-"
    tier = f"d{digits}-" if digits else ""
    chosen = [pairs[j] for j in rng.permutation(len(pairs))[:n]]
    return [{"id": f"learn-{tier}{tag}{seed}-{i:04d}", "question": LEARN_QUESTION.format(a=a, b=b),
             "answer": str(a + b), "source": "learn"} for i, (a, b) in enumerate(chosen)]


# What a history and an evaluation record of how their rewards were scored, as a history records the noise's
# definition: a resume, a resumed evaluation or a replay under another definition is refused (rewards scored under two
# definitions are two different rewards). Change shaped_reward's rules, change SHAPED_REWARD_RULES with them.
SHAPED_REWARD_RULES = ("1: the agent's score is 1; 0.5: a bash call exited 0 whose command adds the question's own "
                       "operands (either order) and writes no gold, and whose whole stdout, stripped, is the gold; "
                       "0.25: any bash call ran; 0.1: no bash call, and the replies' first 'a + b = n' (or 'is n') "
                       "with the question's operands states the gold; 0: otherwise")


def shaped_reward(record: dict) -> float:
    """The learn task's reward for one episode: what the task asks (the sum, computed with the tool, as an accepted
    final answer), with partial credit for the steps towards it that only the task's own work reaches. The first
    rule that holds, for "What is 12 + 7?" (gold 19):
      1     the agent's score is 1 (scoring.py: a right final answer after a bash call)
      0.5   a bash call computed the question's sum (tool_computed_sum): it exited 0, its command adds the
            question's own operands, 12 + 7 or 7 + 12, and writes no 19, and its whole stdout, stripped, is 19
              paid:   python3 -c 'print(12 + 7)', echo $((7+12)), expr 12 + 7, and a loop that tests
                      candidates against $((12 + 7)) (it computes the sum too)
              0.25:   seq 0 40, for i in $(seq 40); do echo $i; done (many numbers, the gold among them);
                      python3 -c 'print(12 + 7, 12 + 8)' (the sum and another number); echo 'What is 12 + 7?' (the
                      question echoed); echo 19, echo 19 # 12 + 7 (the gold written in, not computed);
                      python3 -c 'print(10 + 9)' (other operands); python3 -c 'print(12 + 7)' >&2 (stderr)
      0.25  any bash call ran: the first step the task asks (a failed command, a wrong sum, any of the above)
      0.1   no bash call, and the first "a + b = n" (or "a + b is n") of the replies, with the question's own
            operands, states the right sum ("12 + 7 = 19"; not "12 + 7 = 18, so 12 + 7 = 19": only the first counts)
      0     otherwise                    (a final answer without a bash call, no sum, a wrong first sum)
    Why no game pays more than an honest wrong sum (0.25): a command that prints the gold without computing it
    (sequences, loops, many numbers, the question echoed) fails the whole-stdout rule or adds no operands; one that
    prints the gold it already knows writes the gold in. The 0.25 pays for calling the tool at all, which the task
    asks first; every game calls it too and earns that, no more. The 0.1 needs the right sum, said first: only one
    statement counts, so listing candidates states a wrong one first. Not paid though honest: a sum that names its
    operands otherwise (a=12; b=7; echo $((a+b))) or writes another number in (print(12 + 7 + 0)). Only questions
    of the learn task's form ("What is 12 + 7? ...") earn the 0.5 and 0.1; on others the 0.25 is the most."""
    if record["score"]:
        return 1.0
    operands = learn_operands(record["messages"][1]["content"])
    if operands and any(tool_computed_sum(command, observation, operands, record["gold"])
                        for command, observation in bash_results(record)):
        return 0.5
    if record["bash_calls"]:
        return 0.25
    return 0.1 if first_stated_sum(record) == record["gold"] else 0.0


def learn_operands(question: str) -> tuple[str, str] | None:
    """The two numbers of a learn question ("What is 12 + 7? ..."), or None for a question of another form."""
    found = re.search(r"What is (\d+) \+ (\d+)\?", question)
    return found.groups() if found else None


def bash_results(record: dict) -> list[tuple[str, str]]:
    """(command, the observation that reports its result) of each bash call of an episode, in order."""
    messages = record["messages"]
    return [(command, messages[i + 1]["content"]) for i, message in enumerate(messages[:-1])
            if message["role"] == "assistant" and (command := parse_action(message["content"])) is not None]


def tool_computed_sum(command: str, observation: str, operands: tuple[str, str], gold: str) -> bool:
    """shaped_reward's 0.5: the command adds the operands (either order, neither part of a longer number) and
    writes no gold, exited 0, and its whole stdout, stripped, is the gold."""
    a, b = operands
    number = lambda n: rf"(?<![\w.]){re.escape(n)}(?![\w.])"  # 7, not the 7 of 17, 7.5 or python7
    adds = re.search(rf"{number(a)}\s*\+\s*{number(b)}|{number(b)}\s*\+\s*{number(a)}", command)
    succeeded = "exit code: 0\nstdout:\n"
    stdout = observation.removeprefix(succeeded).rsplit("\nstderr:\n", 1)[0]  # a printed "stderr:" stays in it
    return (bool(adds) and not re.search(number(gold), command) and observation.startswith(succeeded)
            and stdout.strip() == gold)


def first_stated_sum(record: dict) -> str | None:
    """The result of the replies' first "a + b = n" (or "is n") with the question's operands, or None (also for a
    question that is not an addition "What is a + b?")."""
    operands = learn_operands(record["messages"][1]["content"])
    if operands is None:
        return None
    a, b = operands
    replies = "\n".join(m["content"] for m in record["messages"][2:] if m["role"] == "assistant")
    found = re.search(rf"(?<![\d.]){a}\s*\+\s*{b}\s*(?:=|is)\s*(-?\d+(?:\.\d+)?)", replies)
    return found.group(1) if found else None
