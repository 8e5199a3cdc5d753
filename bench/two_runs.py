"""Two learning runs at once on one GPU machine: each a bench/learning.py process with its own co-located engines
(under CUDA MPS), started at the same moment, so that one run's engine starts, restore copies and shutdowns fall
inside the other's. Both must finish, training and held-out evaluation. The report holds each run's exit status,
its held-out result, how often it waited for the other process at the machine-wide GPU memory lock, and any of
vLLM's memory-profiling failures in its log.

    python bench/two_runs.py --out=bench/results/two_runs_h200x1.json --engines=4 --tensor_parallel_size=1 \\
        --gpu_memory_utilization=0.1

Script options (defaults in OPTIONS): out, seeds (comma-separated run seeds, one process each), run_root. Every
other --key=value goes to both bench/learning.py processes.
"""

import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import common  # noqa: E402
from agentic_es import cli, fileio  # noqa: E402
from report import emit, print_until_reader_gone  # noqa: E402

OPTIONS = {"out": "", "seeds": "20260627,20260628", "run_root": "runs/two_runs"}
LOCK_WAIT = "another process is changing GPU memory on this machine"
MEMORY_FAILURES = ("Error in memory profiling", "No available memory for the cache blocks")


def run_summary(seed: int, returncode: int, log: Path, report_path: Path, history: Path) -> dict:
    """One process's exit status, generations trained, held-out result and what its log says about the GPU memory
    lock."""
    text = log.read_text(errors="replace")
    trained = len(fileio.read_json(history)["generations"]) if history.exists() else 0
    summary = {"run_seed": seed, "exit_status": returncode, "log": str(log), "generations_trained": trained,
               "gpu_memory_lock_waits": text.count(LOCK_WAIT),
               "memory_profiling_failures": sum(text.count(f) for f in MEMORY_FAILURES)}
    if report_path.exists():
        run = fileio.read_json(report_path)["runs"][0]
        summary.update(heldout_reward=run["reward"], replay_digests_equal_training=run["replay_digests_equal_training"],
                       train_generation_seconds=run["train_generation_seconds"], eval_seconds=run["eval_seconds"])
    return summary


def finished(process: subprocess.Popen) -> int:
    """Its exit status; a SIGINT (the device call's time limit) reached both runs too: they stop between history
    writes and resume in the next call, so wait for them rather than leave them behind."""
    while True:
        try:
            return process.wait()
        except KeyboardInterrupt:
            continue


def main(argv):
    opts, overrides = cli.parse_args(argv, OPTIONS)
    seeds = [int(s) for s in str(opts["seeds"]).split(",")]
    root = Path(opts["run_root"])
    root.mkdir(parents=True, exist_ok=True)
    t0, processes = time.perf_counter(), []
    for seed in seeds:  # all at once: the overlap is the point
        log, report_path = root / f"log_seed{seed}.txt", root / f"learning_seed{seed}.json"
        command = [sys.executable, str(REPO / "bench" / "learning.py"), f"--out={report_path}", "--seeds=1",
                   f"--run_seed={seed}", f"--run_root={root}", *overrides]
        with open(log, "a") as out:  # a resumed call adds to the log: the counts cover every call
            processes.append((seed, log, report_path, subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)))
    runs = [run_summary(seed, finished(process), log, report_path, root / f"seed-{seed}" / "es_history.json")
            for seed, log, report_path, process in processes]
    report = {"bench": "two_runs", "date": time.strftime("%Y-%m-%d %H:%M"), "argv": argv, "runs": runs,
              "wall_seconds": round(time.perf_counter() - t0, 1),
              "both_completed": all(r["exit_status"] == 0 and "heldout_reward" in r for r in runs),
              "no_memory_profiling_failure": all(r["memory_profiling_failures"] == 0 for r in runs)}
    print("\n".join(map(run_line, runs)))
    return emit(report, opts["out"])


def run_line(run: dict) -> str:
    """One run in a line: its exit status, GPU memory lock waits and held-out reward difference (95% interval)."""
    reward = run.get("heldout_reward", {}).get("difference", {})
    return (f"seed {run['run_seed']}: exit {run['exit_status']}, lock waits {run['gpu_memory_lock_waits']}, "
            f"held-out reward difference {reward.get('mean', float('nan')):+.3f} "
            f"[{reward.get('ci_low', float('nan')):+.3f}, {reward.get('ci_high', float('nan')):+.3f}]")


if __name__ == "__main__":
    print_until_reader_gone()
    main(sys.argv[1:])
