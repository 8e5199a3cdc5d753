"""Do two GPU models draw the same noise? Replays a history made on another device model on this one, with the
device check set aside, and compares every generation's per-rank digests with the recorded ones.

The stages refuse a history of another device model (agentic_es/history.py, device_differences): torch's CUDA
normals are drawn by kernels whose launch shape follows the GPU, so the noise of a seed can differ between models.
Where this bench finds every digest equal for a pair of models, --record=1 writes them to agentic_es/same_noise.json
(history.SAME_NOISE_FILE): a history of one then resumes, exports and replays on the other.

    python bench/noise_across_devices.py --history=bench/results/compute_partial_seed7101_history.json \
        --tensor_parallel_size=1 --gpu_memory_utilization=0.3 --record=1

Prints one JSON line (recorded and current devices, generations replayed, equal or the first generation that
differs) and a table. With --record=1 a pair found equal joins SAME_NOISE_FILE (the group of either model where one
has a group), with what was replayed as its evidence; the stages then accept the history here.
"""

import dataclasses
import datetime
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
from agentic_es import cli, fileio, history as history_module, models, stage  # noqa: E402
from agentic_es.history import config_from_history, read_history, run_identity  # noqa: E402
from agentic_es.pool import EnginePool  # noqa: E402

OPTIONS = {"history": "", "record": 0}


def main(argv: list[str]) -> dict:
    opts, overrides = cli.parse_args(argv, OPTIONS)
    if not opts["history"]:
        raise stage.ConfigError("--history=FILE is required: a history made on another device model")
    history = read_history(opts["history"])
    cfg = config_from_history(history, overrides)
    model_path = models.resolve_model(cfg.model)
    history_module.check_base_files(history, model_path)
    with EnginePool(dataclasses.replace(cfg, engines=1, ray_address=""), model_path, perturbs=False) as pool:
        engine = pool.engines[0]
        identity = run_identity(cfg, model_path, engine, train_data=False)
        # everything but the device model must match, as for an export (the base digests too)
        others = [d for d in history_module.identity_differences(history, identity, compare_config=False)
                  if not d.startswith("devices:")]
        if others:
            raise stage.HistoryMismatch("the history differs in more than its device model: " + "; ".join(others))
        report = {"recorded_devices": history.get("devices"), "current_devices": identity["devices"],
                  "generations": len(history["generations"]), "equal": True, "first_difference": None}
        for record in history["generations"]:
            engine.update(record["seeds"], common.update_coefficients(common.recorded_z(record), record["alpha"]))
            if engine.digests() != record["digests"]:
                report.update(equal=False, first_difference=record["generation"])
                break
    if opts["record"] and report["equal"]:
        record_same_noise(report, opts["history"], identity)
    print(json.dumps(report))
    print(f"| recorded on | replayed on | generations | every digest equal |\n|---|---|---|---|\n"
          f"| {history_module.describe_devices(report['recorded_devices'])} "
          f"| {history_module.describe_devices(report['current_devices'])} | {report['generations']} "
          f"| {report['equal']} (first difference: {report['first_difference']}) |")
    return report


def record_same_noise(report: dict, history_path: str, identity: dict) -> None:
    """Joins the models of a report found equal into one group of SAME_NOISE_FILE, merging the groups either model
    was in, with this replay added to their evidence."""
    path = history_module.SAME_NOISE_FILE
    entries = json.loads(path.read_text()) if path.exists() else []
    group = {(d["name"], d["sm_count"]) for d in report["recorded_devices"] + report["current_devices"]}
    if len(group) < 2:
        return  # the same model: nothing to learn
    joined = [e for e in entries if group & {tuple(m) for m in e["models"]}]
    for entry in joined:
        group |= {tuple(m) for m in entry["models"]}
    evidence = {"history": Path(history_path).name, "generations": report["generations"],
                "recorded_on": history_module.describe_devices(report["recorded_devices"]),
                "replayed_on": history_module.describe_devices(report["current_devices"]),
                "vllm": identity.get("vllm_version"), "torch": identity.get("torch_version"),
                "date": datetime.date.today().isoformat()}
    merged = {"models": sorted(list(m) for m in group),
              "evidence": [x for e in joined for x in e["evidence"]] + [evidence]}
    fileio.write_json_atomic([e for e in entries if e not in joined] + [merged], path)
    print(f"[noise] recorded in {path}: {', '.join(f'{n} ({sm} SMs)' for n, sm in merged['models'])} draw the same noise")


if __name__ == "__main__":
    stage.run_stage(main, "noise_across_devices")
