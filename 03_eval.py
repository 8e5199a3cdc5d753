"""03_eval: not yet implemented (see the project's issues)."""
import sys

if __name__ == "__main__":
    sys.exit("03_eval.py is not yet implemented")
