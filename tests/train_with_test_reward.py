"""01_train.py with a reward that varies across members on a random tiny model (whose agent scores are all 0),
plugged in through main(fitness=...), the training script's one reward seam.

For the interruption tests, ES_TEST_PAUSE=<file>:<n> holds the run after its n-th member step while <file>
exists, having written <file>.paused: the test interrupts it at a known point instead of racing a timer."""

import importlib
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import engine  # noqa: E402

train = importlib.import_module("01_train")


def reply_variety(records: list[dict]) -> float:
    """Distinct characters in each episode's first reply, averaged: deterministic for fixed weights and seeds."""
    firsts = [next((m["content"] for m in r["messages"] if m["role"] == "assistant"), "") for r in records]
    return sum(len(set(text)) for text in firsts) / len(firsts) / 100


def main(argv: list[str]) -> dict:
    return train.main(argv, fitness=reply_variety)


def pause_after_member_steps(gate: str, steps: int) -> None:
    evaluate_member, done = engine.Engine.evaluate_member, [0]

    def evaluate_then_maybe_pause(self, *args, **kwargs):
        result = evaluate_member(self, *args, **kwargs)
        done[0] += 1
        if done[0] == steps:
            Path(gate + ".paused").touch()
            while os.path.exists(gate):
                time.sleep(0.05)
        return result

    engine.Engine.evaluate_member = evaluate_then_maybe_pause


if __name__ == "__main__":
    if os.environ.get("ES_TEST_PAUSE"):
        gate, steps = os.environ["ES_TEST_PAUSE"].rsplit(":", 1)
        pause_after_member_steps(gate, int(steps))
    engine.run_stage(main, "train")
