"""Do two GPU models draw the same noise? Replays a history made on another device model on this one, with the
device check set aside, and compares every generation's per-rank digests with the recorded ones.

The stages refuse a history of another device model (agentic_es/history.py, device_differences): torch's CUDA
normals are drawn by kernels whose launch shape follows the GPU, so the noise of a seed can differ between models.
Where this bench finds every digest equal for a pair of models, they go in agentic_es/history.py's SAME_NOISE: a
history of one resumes, exports and replays on the other; bench/README.md keeps each measurement.

    python bench/noise_across_devices.py --history=bench/results/compute_partial_seed7101_history.json \
        --tensor_parallel_size=1 --gpu_memory_utilization=0.3

Prints one JSON line (recorded and current devices, generations replayed, equal or the first generation that
differs) and a table.
"""

import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
from agentic_es import cli, history as history_module, models, stage  # noqa: E402
from agentic_es.history import config_from_history, read_history, run_identity  # noqa: E402
from agentic_es.pool import EnginePool  # noqa: E402

OPTIONS = {"history": ""}


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
    print(json.dumps(report))
    print(f"| recorded on | replayed on | generations | every digest equal |\n|---|---|---|---|\n"
          f"| {history_module.describe_devices(report['recorded_devices'])} "
          f"| {history_module.describe_devices(report['current_devices'])} | {report['generations']} "
          f"| {report['equal']} (first difference: {report['first_difference']}) |")
    return report


if __name__ == "__main__":
    stage.run_stage(main, "noise_across_devices")
