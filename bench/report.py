"""How every benchmark ends: one JSON line on stdout, and the same report as a file when asked for."""

import json
import os
import sys
from pathlib import Path


def emit(result: dict, out: str = "") -> dict:
    if out:  # the file first: a closed stdout (a pipe into head) must not lose the report
        Path(out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    return result


class StdoutUntilReaderGone:
    """sys.stdout that drops what is printed once its reader has gone (a pipe into head): the bench runs to its end
    and writes its --out file, without a BrokenPipeError traceback."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            self.reader_gone()
            return len(text)

    def flush(self):
        try:
            self.stream.flush()
        except BrokenPipeError:
            self.reader_gone()

    def reader_gone(self):
        # the rest goes to /dev/null, down to the interpreter's own last flush of the real stdout
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self.stream.fileno())
        os.close(devnull)

    def __getattr__(self, name):
        return getattr(self.stream, name)


def print_until_reader_gone():
    """Call first in a bench's __main__."""
    if not isinstance(sys.stdout, StdoutUntilReaderGone):
        sys.stdout = StdoutUntilReaderGone(sys.stdout)
