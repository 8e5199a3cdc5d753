"""04_replay: not yet implemented (see the project's issues)."""
import sys

if __name__ == "__main__":
    sys.exit("04_replay.py is not yet implemented")
