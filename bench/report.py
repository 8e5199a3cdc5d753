"""How every benchmark ends: one JSON line on stdout, and the same report as a file when asked for."""

import json
from pathlib import Path


def emit(result: dict, out: str = "") -> dict:
    print(json.dumps(result))
    if out:
        Path(out).write_text(json.dumps(result, indent=2))
    return result
