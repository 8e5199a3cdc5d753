"""01_train.py with a reward that varies across members on a random tiny model (whose agent scores are all 0): the
agent fitness's per-episode reward (common.EPISODE_REWARDS["agent"], where common.fitness looks it up) replaced by
the variety of the episode's first reply.

For the interruption tests, ES_TEST_PAUSE=<file>:<n> holds the run after its n-th member step while <file>
exists, having written <file>.paused: the test interrupts it at a known point instead of racing a timer."""

import importlib
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
from agentic_es import stage  # noqa: E402

train = importlib.import_module("01_train")


def first_reply_variety(record: dict) -> float:
    """Distinct characters in the episode's first reply / 100: deterministic for fixed weights and seeds."""
    return len(set(next((m["content"] for m in record["messages"] if m["role"] == "assistant"), ""))) / 100


def reply_variety(records: list[dict]) -> float:
    """A member's fitness under this reward: first_reply_variety averaged over its episodes."""
    return sum(map(first_reply_variety, records)) / len(records)


def main(argv: list[str]) -> dict:
    """01_train.main with first_reply_variety as the agent fitness's per-episode reward, for this run only (the
    tests also run it in their own process)."""
    saved = common.EPISODE_REWARDS["agent"]
    common.EPISODE_REWARDS["agent"] = first_reply_variety
    try:
        return train.main(argv)
    finally:
        common.EPISODE_REWARDS["agent"] = saved


def pause_after_member_steps(gate: str, steps: int) -> None:
    evaluate_member, done = common.evaluate_member, [0]

    def evaluate_then_maybe_pause(*args, **kwargs):
        result = evaluate_member(*args, **kwargs)
        done[0] += 1
        if done[0] == steps:
            Path(gate + ".paused").touch()
            while os.path.exists(gate):
                time.sleep(0.05)
        return result

    common.evaluate_member = evaluate_then_maybe_pause  # where run_generation looks it up


if __name__ == "__main__":
    if os.environ.get("ES_TEST_PAUSE"):
        gate, steps = os.environ["ES_TEST_PAUSE"].rsplit(":", 1)
        pause_after_member_steps(gate, int(steps))
    stage.run_stage(main, "train")
