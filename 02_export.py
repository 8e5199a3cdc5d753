"""02_export: not yet implemented (see the project's issues)."""
import sys

if __name__ == "__main__":
    sys.exit("02_export.py is not yet implemented")
