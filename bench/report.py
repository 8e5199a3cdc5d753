"""How every benchmark ends: one JSON line on stdout, and the same report as a file when asked for."""

import json
from pathlib import Path


def emit(result: dict, out: str = "") -> dict:
    if out:  # the file first: a closed stdout (a pipe into head) must not lose the report
        Path(out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    return result
