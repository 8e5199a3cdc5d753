"""01_train.py with a reward that varies across members on a random tiny model (whose agent scores are all 0),
plugged in through main(fitness=...), the training script's one reward seam."""

import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
train = importlib.import_module("01_train")


def reply_variety(records: list[dict]) -> float:
    """Distinct characters in each episode's first reply, averaged: deterministic for fixed weights and seeds."""
    firsts = [next((m["content"] for m in r["messages"] if m["role"] == "assistant"), "") for r in records]
    return sum(len(set(text)) for text in firsts) / len(firsts) / 100


if __name__ == "__main__":
    train.C.prepare_script()
    try:
        train.main(sys.argv[1:], fitness=reply_variety)
    except train.C.EngineFailure as exc:
        sys.exit(f"[train] error: {exc}")
    except train.C.Interrupted as stop:
        sys.exit(stop.exit_status)
