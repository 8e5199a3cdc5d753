"""01_train: not yet implemented (see the project's issues)."""
import sys

if __name__ == "__main__":
    sys.exit("01_train.py is not yet implemented")
