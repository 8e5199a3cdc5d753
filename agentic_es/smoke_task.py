"""The smoke task: tiny arithmetic problems from the run seed ("What is 12 + 7?", "What is 12 * 7?"), for smoke runs
of the whole pipeline (the smoke preset); a random model never answers them, so nothing learns. It has no held-out
set: with smoke_eval, 03_eval.py evaluates these problems in place of the DAPO and AIME files. A task is one module
listed in data.TASKS: SETS (the sets it makes, each by its train_data name, and the split it is), EVAL_SETS (what
03_eval.py evaluates after a run on it; None: the DAPO and AIME files) and set_problems.
"""

from __future__ import annotations

import numpy as np

SMOKE_PROBLEMS = 64
SETS = {"smoke": "train"}
EVAL_SETS = None


def set_problems(split: str, run_seed: int, learn_digits: int = 0, compute_level: int = 1) -> list[dict]:
    """The task's one set: SMOKE_PROBLEMS problems drawn from the run seed."""
    return smoke_problems(SMOKE_PROBLEMS, seed=run_seed)


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
