"""bench/gpu_pipeline.py's report on the files the four stages leave behind, for either noise kind: the
history, an export (sharded_state shards, or a Hugging Face folder) with the manifest export.write_manifest writes
for 02_export.py, the evaluation's metrics and the replay's report. No engine: the digests stand for weights."""

import dataclasses
import sys
from pathlib import Path

import pytest
import torch

import common
from agentic_es import checkpoint_noise, export, fileio, settings
from agentic_es.history import HISTORY_FILE

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import gpu_pipeline  # noqa: E402


def finished_pipeline(run_dir: Path, noise: str, exported_without: str = "") -> list[str]:
    """run_dir as the four stages leave it for a run of this noise kind (a tied base whose stored lm_head.weight
    every loader ignores). exported_without: a base tensor the export leaves out without saying so. Returns the
    trained digests."""
    from safetensors.torch import save_file

    base = run_dir / "base"
    base.mkdir(parents=True)
    tensors = {"model.embed_tokens.weight": torch.ones(6, 4, dtype=torch.bfloat16),
               "model.norm.weight": torch.ones(4, dtype=torch.bfloat16),
               "lm_head.weight": torch.ones(6, 4, dtype=torch.bfloat16)}
    save_file(tensors, str(base / "model.safetensors"))
    fileio.write_json_atomic({"model_type": "qwen3", "tie_word_embeddings": True}, base / "config.json")
    trained = ["ckpt:trained"] if noise == "checkpoint" else ["rank0-trained", "rank1-trained"]
    history = {"config": dataclasses.asdict(common.Config(noise=noise)), "base_model": "tiny", "device_type": "cuda",
               "base_model_path": str(base), "vllm_version": "0.26.0",
               "base_digests": ["ckpt:base"] if noise == "checkpoint" else ["rank0-base", "rank1-base"],
               "generations": [{"generation": 0, "digests": trained}]}
    fileio.write_json_atomic(history, run_dir / HISTORY_FILE)
    folder = run_dir / "export"
    folder.mkdir()
    identity = {"config": history["config"], "tensor_parallel_size": 2, "parameter_names_sha256": "names",
                "devices": [], "base_model": "tiny", "base_fingerprint": "sha256:base", "device_type": "cuda",
                "vllm_version": "0.26.0", "torch_version": torch.__version__}
    if noise == "checkpoint":
        left_out = checkpoint_noise.ignored_checkpoint_tensors(base)
        held = {n: t for n, t in tensors.items() if n not in left_out and n != exported_without}
        save_file(held, str(folder / "model.safetensors"))
        sums = {n: checkpoint_noise.tensor_digest_sum(n, t) for n, t in held.items()}
        weights = export.hugging_face_fields(identity, trained, sums, left_out)
    else:
        for rank in range(2):
            (folder / f"model-rank-{rank}-part-0.safetensors").write_bytes(b"shard %d" % rank)
        weights = export.sharded_state_fields(folder, identity, trained)
    export.write_manifest(folder, export.provenance(history, run_dir / HISTORY_FILE, history["generations"]),
                          identity, weights)
    (run_dir / "eval").mkdir()
    fileio.write_json_atomic({"checkpoint": {"kind": "export", "per_rank_digests": trained}},
                             run_dir / "eval" / "metrics.json")
    fileio.write_json_atomic({"per_rank_digests": trained, "datasets": {"dapo": {"sample_agreement": 1.0}}},
                             run_dir / "eval" / "aligned_history_replay_eval4.json")
    return trained


@pytest.mark.parametrize("noise", settings.NOISE_MODES)
def test_the_report_of_a_finished_pipeline_holds_for_either_noise_kind(tmp_path, noise):
    trained = finished_pipeline(tmp_path, noise)
    report = gpu_pipeline.pipeline_report(tmp_path)
    assert report["ok"] is True and report["noise"] == noise and report["training_digests"] == trained
    assert all(report[check] is True for check in gpu_pipeline.CHECKS[noise])
    if noise == "checkpoint":  # the tied head: left out, and the manifest says so
        assert report["base_tensors_left_out"] == ["lm_head.weight"] and report["base_tensors_missing"] == []


def test_a_hugging_face_export_that_drops_a_base_tensor_fails_the_report(tmp_path):
    finished_pipeline(tmp_path, "checkpoint", exported_without="model.norm.weight")
    report = gpu_pipeline.pipeline_report(tmp_path)
    assert report["export_verifies"] is True  # its files match its own manifest ...
    assert report["export_holds_every_base_tensor"] is False and report["ok"] is False  # ... which lacks a tensor
    assert report["base_tensors_missing"] == ["model.norm.weight"]


@pytest.mark.parametrize("noise", settings.NOISE_MODES)
@pytest.mark.parametrize("damage, failed", [
    ("eval/metrics.json", "moe_round_trip_exact"),
    ("eval/aligned_history_replay_eval4.json", "replay_equals_export"),
    ("export file", "export_verifies"),
])
def test_each_failed_check_fails_the_report(tmp_path, noise, damage, failed):
    finished_pipeline(tmp_path, noise)
    if damage == "export file":
        victim = next(f for f in (tmp_path / "export").iterdir() if f.name.endswith(".safetensors"))
        victim.write_bytes(victim.read_bytes() + b"x")
    else:
        record = fileio.read_json(tmp_path / damage)
        key = record["checkpoint"] if "checkpoint" in record else record
        key["per_rank_digests"] = ["other"] * len(key["per_rank_digests"])
        fileio.write_json_atomic(record, tmp_path / damage)
    report = gpu_pipeline.pipeline_report(tmp_path)
    assert report[failed] is False and report["ok"] is False
    if failed != "export_verifies":  # an export that fails verification has no digests to compare
        assert [c for c in gpu_pipeline.CHECKS[noise] if report[c] is not True] == [failed]


@pytest.mark.parametrize("noise", settings.NOISE_MODES)
def test_a_missing_stage_output_fails_the_report_without_crashing(tmp_path, noise):
    finished_pipeline(tmp_path, noise)
    (tmp_path / "eval" / "aligned_history_replay_eval4.json").unlink()
    report = gpu_pipeline.pipeline_report(tmp_path)
    assert report["ok"] is False and "aligned_history_replay_eval4.json" in report["report_error"]


def test_a_stopped_pipeline_goes_on_from_its_first_unfinished_stage(tmp_path, monkeypatch):
    """Each stage's output is in its log as it runs; a second call with the same run_dir runs only the stages that
    did not finish (a stage that failed the first time runs again, the ones before it do not)."""
    script = tmp_path / "stage.py"
    script.write_text("import sys, pathlib\n"
                      "name = sys.argv[1]\n"
                      "runs = pathlib.Path(sys.argv[2]) / (name + '.runs')\n"
                      "runs.write_text(runs.read_text() + 'x' if runs.exists() else 'x')\n"
                      "print('stage', name, 'ran', flush=True)\n"
                      "sys.exit(1 if name == 'second' and len(runs.read_text()) == 1 else 0)\n")
    counts = tmp_path / "counts"
    counts.mkdir()
    stages = [(name, str(script)) for name in ("first", "second", "third")]
    monkeypatch.setattr(gpu_pipeline, "STAGES", stages)
    monkeypatch.setattr(gpu_pipeline, "pipeline_report", lambda run_dir: {"ok": True})
    run_dir, out = tmp_path / "run", tmp_path / "report.json"
    # each stage gets the pipeline's arguments after its own two (name, counts folder)
    monkeypatch.setattr(gpu_pipeline, "REPO", tmp_path)
    real_run_stage = gpu_pipeline.run_stage
    monkeypatch.setattr(gpu_pipeline, "run_stage", lambda name, command, rd: real_run_stage(
        name, [command[0], command[1], name, str(counts), *command[2:]], rd))

    first = gpu_pipeline.main([f"--run_dir={run_dir}", f"--out={out}"])
    assert first["ok"] is False and first["stages"]["second"]["returncode"] == 1
    assert "third" not in first["stages"]
    assert "stage second ran" in (run_dir / "second.log").read_text()
    second = gpu_pipeline.main([f"--run_dir={run_dir}", f"--out={out}"])
    assert second["ok"] is True and second["stages"]["first"]["earlier_call"] is True
    assert {n: (counts / f"{n}.runs").read_text() for n, _ in stages} == {"first": "x", "second": "xx", "third": "x"}
