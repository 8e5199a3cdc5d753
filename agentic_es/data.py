"""The problems the agent solves: problem files (JSONL, checked line by line), and the problem sets of the tasks made
here (TASKS: a task is one module, smoke_task.py, learn_task.py, compute_task.py, and one line there). The
per-generation case batch drawn from them is the algorithm's (common.case_batch)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from agentic_es import compute_task, fileio, learn_task, smoke_task, stage

REQUIRED_PROBLEM_FIELDS = ("id", "question", "answer")
# at the top of the repository: the problem files 00_data.py builds (ids, answers, sha256s)
DATA_MANIFEST = Path(__file__).resolve().parents[1] / "data_manifest.json"
# The tasks whose problems are made here, by the train_data name of their training set: a task is one module (its
# problems, wording and rewards; SETS, EVAL_SETS, set_problems) and one line here
TASKS = {
    "smoke": smoke_task,
    "learn": learn_task,
    "compute": compute_task,
}
SET_TASKS = {name: task for task in TASKS.values() for name in task.SETS}  # every set made here -> its task
GENERATED_DATA = tuple(SET_TASKS)  # problem sets made here (no file to hash)
HELD_OUT_DATA = {  # generated sets that are never trained on -> the training set of their task
    name: train for train, task in TASKS.items() for name, split in task.SETS.items() if split != "train"}


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
    """A problems file, or problems made here (a set of a task of TASKS): "smoke" (tiny arithmetic problems from the
    run seed),
    "learn" (the learn task's one fixed training set), "learn_heldout" (every held-out question of the learn
    task, in one fixed order: none shares its operands with a training question); the learn task of the tier
    learn_digits (0: the numbers 2..19); "compute", "compute_heldout", "compute_families": the compute task's
    training set, its held-out parameters of the training families and its held-out families, of the level
    compute_level (compute_task.problems, fixed whatever the run seed)."""
    if path in SET_TASKS:
        task = SET_TASKS[path]
        return task.set_problems(task.SETS[path], run_seed, learn_digits, compute_level)
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
