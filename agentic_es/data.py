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

from agentic_es import compute_task, fileio, learn_task, stage

REQUIRED_PROBLEM_FIELDS = ("id", "question", "answer")
# at the top of the repository: the problem files 00_data.py builds (ids, answers, sha256s)
DATA_MANIFEST = Path(__file__).resolve().parents[1] / "data_manifest.json"
SMOKE_PROBLEMS = 64
# problem sets made here (no file to hash)
GENERATED_DATA = ("smoke", "learn", "learn_heldout", "compute", "compute_heldout", "compute_families")
HELD_OUT_DATA = {  # generated sets that are never trained on -> the training set of their task
    "learn_heldout": "learn", "compute_heldout": "compute", "compute_families": "compute"}
COMPUTE_SPLITS = {"compute": "train", "compute_heldout": "heldout", "compute_families": "families"}
LEARN_SPLITS = {"learn": "train", "learn_heldout": "heldout"}  # learn_task.py


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
    if path in LEARN_SPLITS:
        return learn_task.problems(LEARN_SPLITS[path], learn_digits)
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
