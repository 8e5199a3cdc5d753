"""The problems the agent solves: problem files (JSONL, checked line by line), and the problem sets made here (the
smoke preset's arithmetic from a seed; the learn task's training and held-out additions, of the numbers 2..19 or, as
harder tiers, of two D-digit numbers: Config.learn_digits; the compute task's training and held-out problems of a
level, compute_task.py: Config.compute_level). The per-generation case batch drawn from them is the algorithm's
(common.case_batch)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from agentic_es import compute_task, fileio, stage

REQUIRED_PROBLEM_FIELDS = ("id", "question", "answer")
# at the top of the repository: the problem files 00_data.py builds (ids, answers, sha256s)
DATA_MANIFEST = Path(__file__).resolve().parents[1] / "data_manifest.json"
SMOKE_PROBLEMS = 64
# problem sets made here (no file to hash)
GENERATED_DATA = ("smoke", "learn", "learn_heldout", "compute", "compute_heldout", "compute_families")
HELD_OUT_DATA = {  # generated sets that are never trained on -> the training set of their task
    "learn_heldout": "learn", "compute_heldout": "compute", "compute_families": "compute"}
COMPUTE_SPLITS = {"compute": "train", "compute_heldout": "heldout", "compute_families": "families"}
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


def load_problems(path):
    """Read a problems JSONL file: one object per line with string id, question, answer (other fields kept)."""
    if os.path.isdir(path):
        raise stage.DataError(f"{path}: a folder, not a problems file")
    if not os.path.isfile(path):
        raise stage.DataError(f"{path}: problems file not found{build_hint(path)}")
    problems, line_of_id = [], {}
    try:
        with open(path, "rb") as f:
            lines = f.read().split(b"\n")
    except OSError as e:
        raise stage.DataError(f"{path}: cannot read it ({e.strerror or e})") from None
    for lineno, raw in enumerate(lines, start=1):
        where = f"{path}:{lineno}"
        try:
            line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")  # (a byte order mark may open the file)
        except UnicodeDecodeError as e:
            raise stage.DataError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start} of the line)") from None
        if not line.strip():
            continue  # tolerate blank lines (e.g. a trailing empty line)
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise stage.DataError(f"{where}: malformed JSON ({e.msg})") from None
        if not isinstance(row, dict):
            raise stage.DataError(f"{where}: expected a JSON object, got {type(row).__name__}")
        for field in REQUIRED_PROBLEM_FIELDS:
            if field not in row:
                raise stage.DataError(f"{where}: missing required field {field!r}")
            if not isinstance(row[field], str):
                raise stage.DataError(f"{where}: field {field!r} must be a string, got {type(row[field]).__name__}")
            if not row[field].strip():
                raise stage.DataError(f"{where}: field {field!r} is empty")
        pid = row["id"]
        if pid in line_of_id:
            raise stage.DataError(f"{where}: duplicate id {pid!r} (first seen on line {line_of_id[pid]})")
        line_of_id[pid] = lineno
        problems.append(row)
    if not problems:
        raise stage.DataError(f"{path}: no problems in file")
    return problems


def build_hint(path) -> str:
    """For a missing file that 00_data.py builds: the exact command that builds it."""
    folder, name = os.path.split(os.path.normpath(path))
    if name not in json.loads(DATA_MANIFEST.read_text())["files"]:
        return ""
    command = "python 00_data.py" + ("" if folder == "data" else f" --out={folder or '.'}")
    return f"; build it with: {command}"


def problems_from(path, run_seed, learn_digits=0, compute_level=1):
    """A problems file, or problems made here: "smoke" (SMOKE_PROBLEMS tiny arithmetic problems from the run seed),
    "learn" (the learn task's one fixed training set), "learn_heldout" (every held-out question of the learn
    task, in one fixed order: none shares its operands with a training question); the learn task of the tier
    learn_digits (0: the numbers 2..19); "compute", "compute_heldout", "compute_families": the compute task's
    training set, its held-out parameters of the training families and its held-out families, of the level
    compute_level (compute_task.problems, fixed whatever the run seed)."""
    if path in COMPUTE_SPLITS:
        return compute_task.problems(COMPUTE_SPLITS[path], compute_level)
    if path == "smoke":
        return smoke_problems(SMOKE_PROBLEMS, seed=run_seed)
    if path == "learn":
        return learn_problems(LEARN_PROBLEMS, seed=LEARN_TRAIN_SEED, digits=learn_digits)
    if path == "learn_heldout":
        return learn_problems(2 * LEARN_HELDOUT_PAIRS, seed=LEARN_HELDOUT_SEED, split="heldout", digits=learn_digits)
    return load_problems(path)


def problems_sha256(path, run_seed, learn_digits=0, compute_level=1) -> str:
    """What identifies the problems of problems_from(path, run_seed, learn_digits, compute_level) by content: a
    file's sha256, or for problems made here (GENERATED_DATA) the name and the sha256 of the problems themselves. A
    history records it of its training data, an evaluation of each set it evaluates; a changed file at the same path
    is another one."""
    if path not in GENERATED_DATA:
        return fileio.sha256_file(path)
    problems = json.dumps(problems_from(path, run_seed, learn_digits, compute_level), sort_keys=True).encode()
    return f"{path} {hashlib.sha256(problems).hexdigest()}"


def smoke_problems(n, seed=0):
    """n tiny deterministic arithmetic problems, for smoke runs of the whole pipeline."""
    rng = np.random.default_rng([int(seed)])
    rows = []
    for i in range(n):
        a, b = (int(x) for x in rng.integers(2, 100, size=2))
        if rng.random() < 0.5:
            question, answer = f"What is {a} + {b}?", a + b
        else:
            question, answer = f"What is {a} * {b}?", a * b
        rows.append({"id": f"smoke-{i:03d}", "question": question, "answer": str(answer), "source": "smoke"})
    return rows


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


def training_problems(cfg) -> list[dict]:
    """The training set: a JSONL file, or the preset's problems generated here ("smoke", "learn", "compute")."""
    if cfg.train_data in HELD_OUT_DATA:
        task = HELD_OUT_DATA[cfg.train_data]
        raise stage.ConfigError(f"train_data={cfg.train_data} is the {task} task's held-out set, which is never "
                                f"trained on; train on --train_data={task}")
    problems = problems_from(cfg.train_data, cfg.run_seed, cfg.learn_digits, cfg.compute_level)
    if cfg.case_batch > len(problems):
        raise stage.DataError(f"case_batch={cfg.case_batch} is larger than the {len(problems)} problems of "
                              f"{cfg.train_data}")
    return problems
