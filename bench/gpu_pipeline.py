"""The four stages on 2 GPUs (TP=2) with the tiny random Qwen3-MoE, reduced counts (the smoke preset), and a
member-dependent test reward so the weights really move. Checks: export digests == training's final digests;
the MoE round trip is exact (03_eval loads the export and compares the loaded digests with the manifest);
replay digests == export digests. With --noise=checkpoint the export is a Hugging Face folder, and it must hold
every base tensor except those its manifest names as left out. Writes a JSON report.

    python bench/gpu_pipeline.py --out=$OUT/gpu_pipeline.json --run_dir=/tmp/gpu-pipeline
    python bench/gpu_pipeline.py --restore=copy_host ...   # the exact-restore copy in pinned host memory
    python bench/gpu_pipeline.py --noise=checkpoint ...    # checkpoint noise: a Hugging Face export
    python bench/gpu_pipeline.py --qwen3_30b_layers=2 --tensor_parallel_size=1 --gpu_memory_utilization=0.3 ...

--qwen3_30b_layers=n runs the stages on Qwen3-30B-A3B's layout cut to n layers instead (random bf16 safetensors
written by qwen3_30b.py, with the tiny model's tokenizer: its vocabulary, the real layer dimensions).

Each stage's output streams to run_dir/<stage>.log; a stage that finished leaves run_dir/<stage>.done.json, and the
same command with the same --run_dir goes on from the first unfinished stage (01_train resumes its history).

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
import common  # noqa: E402
import qwen3_30b  # noqa: E402
from agentic_es import checkpoint_noise, cli, data, export, fileio, models, smoke_task, stage  # noqa: E402
from agentic_es.history import HISTORY_FILE  # noqa: E402
from report import print_until_reader_gone  # noqa: E402

STAGES = [
    ("train", "tests/train_with_test_reward.py"),
    ("export", "02_export.py"),
    ("eval", "03_eval.py"),
    ("replay", "04_replay.py"),
]
# the checks `ok` needs, per noise kind (the history's config says which)
CHECKS = {
    "rank_salted": ("weights_moved", "export_verifies", "export_equals_training", "moe_round_trip_exact",
                    "replay_equals_export"),
    "checkpoint": ("weights_moved", "export_verifies", "export_holds_every_base_tensor", "export_equals_training",
                   "moe_round_trip_exact", "replay_equals_export"),
}


def main(argv):
    opts, overrides = cli.parse_args(argv, {"out": "gpu_pipeline.json", "run_dir": "/tmp/gpu-pipeline",
                                          "qwen3_30b_layers": 0})
    run_dir = Path(opts["run_dir"])
    run_dir.mkdir(parents=True, exist_ok=True)
    model = "tiny-qwen3-moe"
    if opts["qwen3_30b_layers"]:
        folder = Path(f"/tmp/qwen3-30b-a3b-{opts['qwen3_30b_layers']}layers")
        if not (folder / "model.safetensors.index.json").exists():
            t0 = time.perf_counter()
            qwen3_30b.write_config(folder, tokenizer_from=models.resolve_model("tiny-qwen3-moe"),
                                   layers=opts["qwen3_30b_layers"])
            qwen3_30b.write_random_checkpoint(folder)
            print(f"[gpu_pipeline] {folder}: random weights written in {time.perf_counter() - t0:.0f} s", flush=True)
        model = str(folder)
    eval_data = run_dir / "eval_problems.jsonl"  # the GPU machine has no ../shared/data: tiny problems instead
    fileio.write_jsonl(smoke_task.smoke_problems(2, seed=7), eval_data)
    args = ["--preset=smoke", f"--model={model}", f"--run_dir={run_dir}", *overrides]
    report = {"bench": "gpu_pipeline", "date": time.strftime("%Y-%m-%d"), "args": args, "stages": {}}
    for name, script in STAGES:
        done = run_dir / f"{name}.done.json"
        if done.exists():  # finished by an earlier call with this run_dir: the stages resume, never repeat
            report["stages"][name] = {**fileio.read_json(done), "earlier_call": True}
            print(f"[gpu_pipeline] {name}: done in an earlier call", flush=True)
            continue
        extra = [f"--dapo={eval_data}", f"--aime2026={eval_data}"] if name == "eval" else []
        report["stages"][name] = run_stage(name, [sys.executable, str(REPO / script), *args, *extra], run_dir)
        if report["stages"][name]["returncode"]:
            report["ok"] = False
            break
        fileio.write_json_atomic(report["stages"][name], done)
    else:
        report.update(pipeline_report(run_dir))
    Path(opts["out"]).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    return report


def run_stage(name: str, command: list[str], run_dir: Path) -> dict:
    """One stage, its output streamed to run_dir/<name>.log (a call stopped by its time limit still shows how far
    it got): seconds, return code, and the log's tail."""
    print(f"[gpu_pipeline] {name}: {' '.join(command[1:])}  (log: {run_dir / f'{name}.log'})", flush=True)
    t0 = time.perf_counter()
    with open(run_dir / f"{name}.log", "w") as log:
        returncode = subprocess.run(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT).returncode
    seconds = round(time.perf_counter() - t0, 1)
    print(f"[gpu_pipeline] {name}: exit {returncode} after {seconds} s", flush=True)
    tail = (run_dir / f"{name}.log").read_text(errors="replace")[-1500 if returncode else -600:]
    return {"seconds": seconds, "returncode": returncode, "tail": tail}


def pipeline_report(run_dir: Path) -> dict:
    """The checks of a finished pipeline's files in run_dir (history, export/, eval/), for either noise kind, and
    ok: every check of the run's kind holds. A file that is missing or unreadable fails the report, never crashes
    it."""
    try:
        history = fileio.read_json(run_dir / HISTORY_FILE)
        kind = history["config"].get("noise", "rank_salted")
        report = {"noise": kind, "device_type": history["device_type"], "vllm_version": history["vllm_version"]}
        report.update(export_checks(run_dir / "export", history))
        metrics = fileio.read_json(run_dir / "eval" / "metrics.json")
        replay = fileio.read_json(run_dir / "eval" / "aligned_history_replay_eval4.json")
    except (OSError, KeyError, ValueError, stage.StageError) as e:
        return {"report_error": f"{type(e).__name__}: {e}", "ok": False}
    trained = history["generations"][-1]["digests"]
    report.update({
        "weights_moved": trained != history["base_digests"],
        "export_equals_training": report["export_digests"] == trained,
        "moe_round_trip_exact": metrics["checkpoint"]["per_rank_digests"] == trained,  # checked after loading
        "replay_equals_export": replay["per_rank_digests"] == report["export_digests"],
        "replay_sample_agreement": {n: d["sample_agreement"] for n, d in replay["datasets"].items()},
        "training_digests": trained,
    })
    report["ok"] = all(report.get(check) is True for check in CHECKS[kind])
    return report


def export_checks(folder: Path, history: dict) -> dict:
    """The export's digests as the stages record them, whether its files match its manifest and SHA256SUMS, and
    for a Hugging Face export (checkpoint noise) whether it holds every base tensor but the ones its manifest
    names as left out."""
    try:
        manifest = export.verify(folder)
    except stage.ExportError as e:
        return {"export_verifies": False, "export_error": str(e), "export_digests": None}
    if not export.is_hugging_face(manifest):
        return {"export_verifies": True, "export_digests": export.digests(manifest)}
    base = {name for name, _ in checkpoint_noise.checkpoint_tensors(history["base_model_path"])}
    exported = {name for name, _ in checkpoint_noise.checkpoint_tensors(folder)}
    left_out = set(manifest.get("left_out_tensors", {}))
    return {"export_verifies": True, "export_digests": export.digests(manifest),
            "export_holds_every_base_tensor": (exported == base - left_out and left_out <= base
                                               and exported == set(manifest["tensor_digest_sums"])),
            "base_tensors_left_out": sorted(left_out), "base_tensors_missing": sorted(base - exported - left_out)}


if __name__ == "__main__":
    print_until_reader_gone()
    sys.exit(0 if main(sys.argv[1:])["ok"] else 1)
