"""The four stages on 2 GPUs (TP=2) with the tiny random Qwen3-MoE, reduced counts (the smoke preset), and a
member-dependent test reward so the weights really move. Checks: export digests == training's final digests;
the MoE sharded_state round trip is exact (03_eval loads the export and compares the loaded per-rank digests with
the manifest); replay digests == export digests. Writes a JSON report.

    python bench/gpu_pipeline.py --out=$OUT/gpu_pipeline.json --run_dir=/tmp/gpu-pipeline
    python bench/gpu_pipeline.py --restore=copy_host ...   # the exact-restore copy in pinned host memory

Export and replay only apply updates, so "export == training digests" also proves that every restore during
training (from the GPU copy, or with --restore=copy_host from pinned host memory) was bit-exact.
"""

import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import common as C  # noqa: E402

STAGES = [
    ("train", "tests/train_with_test_reward.py"),
    ("export", "02_export.py"),
    ("eval", "03_eval.py"),
    ("replay", "04_replay.py"),
]


def main(argv):
    opts, overrides = C.parse_args(argv, {"out": "gpu_pipeline.json", "run_dir": "/tmp/gpu-pipeline"})
    run_dir = Path(opts["run_dir"])
    run_dir.mkdir(parents=True, exist_ok=True)
    eval_data = run_dir / "eval_problems.jsonl"  # the GPU machine has no ../shared/data: tiny problems instead
    C.write_jsonl(C.smoke_problems(2, seed=7), eval_data)
    args = ["--preset=smoke", "--model=tiny-qwen3-moe", f"--run_dir={run_dir}", *overrides]
    report = {"bench": "gpu_pipeline", "date": time.strftime("%Y-%m-%d"), "args": args, "stages": {}}
    for name, script in STAGES:
        t0 = time.perf_counter()
        extra = [f"--dapo={eval_data}", f"--aime2026={eval_data}"] if name == "eval" else []
        proc = subprocess.run([sys.executable, str(REPO / script), *args, *extra], cwd=REPO, capture_output=True,
                              text=True)
        (run_dir / f"{name}.log").write_text(proc.stdout + proc.stderr)
        report["stages"][name] = {"seconds": round(time.perf_counter() - t0, 1), "returncode": proc.returncode,
                                  "tail": (proc.stdout + proc.stderr)[-1500:] if proc.returncode else proc.stdout[-600:]}
        if proc.returncode:
            break
    else:
        history = C.read_json(run_dir / C.HISTORY_FILE)
        manifest = C.read_json(run_dir / "export" / C.EXPORT_MANIFEST)
        metrics = C.read_json(run_dir / "eval" / "metrics.json")
        replay = C.read_json(run_dir / "eval" / "aligned_history_replay_eval4.json")
        trained = history["generations"][-1]["digests"]
        report.update({
            "device_type": history["device_type"], "vllm_version": history["vllm_version"],
            "weights_moved": trained != history["base_digests"],
            "export_equals_training": manifest["per_rank_digests"] == trained,
            "moe_round_trip_exact": metrics["checkpoint"]["per_rank_digests"] == trained,  # checked after loading
            "replay_equals_export": replay["per_rank_digests"] == manifest["per_rank_digests"],
            "replay_sample_agreement": {n: d["sample_agreement"] for n, d in replay["datasets"].items()},
            "training_digests": trained,
        })
    report["ok"] = all(report.get(k) for k in ("weights_moved", "export_equals_training", "moe_round_trip_exact",
                                               "replay_equals_export"))
    Path(opts["out"]).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    sys.exit(0 if main(sys.argv[1:])["ok"] else 1)
