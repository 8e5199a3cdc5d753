"""bench/noise_across_devices.py: a history made on another device model replayed here digest by digest, with only
the device check set aside. The engine pool is a stand-in (no engine; the replay on a real one is common.replay's,
tested in test_es_engine.py): what is checked is which differences are set aside and how a divergence is reported."""

import dataclasses
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import noise_across_devices  # noqa: E402

import common  # noqa: E402
from agentic_es import cli, history, stage  # noqa: E402
from agentic_es.history import HISTORY_FORMAT  # noqa: E402

H100 = {"name": "NVIDIA H100 80GB HBM3", "sm_count": 132}
H200 = {"name": "NVIDIA H200", "sm_count": 132}


def write_history(path: Path, generations: int = 3) -> dict:
    cfg = cli.parse_config(["--preset=compute", "--model=tiny-qwen3-dense", "--population=2", "--run_dir=/tmp/x"])
    records = [{"generation": g, "sigma": 1e-3, "alpha": cfg.alpha, "seeds": [g, g + 10], "rewards": [0.0, 1.0],
                "z": common.zscore([0.0, 1.0]), "problem_ids": ["p"], "digests": [f"d{g}"], "timings": {}}
               for g in range(generations)]
    header = {"format": HISTORY_FORMAT, "config": dataclasses.asdict(cfg), "base_model": cfg.model,
              "base_fingerprint": "sha256:base", "base_digests": ["b"], "tensor_parallel_size": 1,
              "device_type": "cuda", "devices": [H200]}
    path.write_text(json.dumps({**header, "generations": records}))
    return header


@pytest.fixture
def replay_here(monkeypatch):
    """The bench on a stand-in engine of `devices` whose digests follow the history's for `equal_for` generations."""
    def run(path, header, devices, equal_for, argv=(), **identity_changes):
        updates = []

        class Engine:
            def update(self, seeds, coefficients):
                updates.append(seeds)

            def digests(self):
                g = len(updates) - 1
                return [f"d{g}"] if g < equal_for else ["other"]

        class Pool:
            def __init__(self, cfg, model_path, **kwargs):
                assert cfg.engines == 1 and kwargs == {"perturbs": False}  # one read-only engine
                self.engines = [Engine()]

            def __enter__(self):
                return self

            def __exit__(self, *exc):
                return False

        identity = {k: v for k, v in header.items() if k != "config"}
        monkeypatch.setattr(noise_across_devices, "EnginePool", Pool)
        monkeypatch.setattr(noise_across_devices.models, "resolve_model", lambda name, *a, **k: name)
        monkeypatch.setattr(history, "check_base_files", lambda *a: None)
        monkeypatch.setattr(noise_across_devices, "run_identity",
                            lambda *a, **k: {**identity, "devices": devices, **identity_changes})
        return noise_across_devices.main([f"--history={path}", *argv]), updates
    return run


def test_every_generation_equal_on_another_model(tmp_path, replay_here):
    header = write_history(tmp_path / "h.json")
    report, updates = replay_here(tmp_path / "h.json", header, [H100], equal_for=3)
    assert report["equal"] and report["first_difference"] is None and report["generations"] == 3
    assert report["recorded_devices"] == [H200] and report["current_devices"] == [H100]
    assert updates == [[0, 10], [1, 11], [2, 12]]  # every recorded update, in order


def test_the_first_generation_that_differs_is_named_and_the_replay_stops_there(tmp_path, replay_here):
    header = write_history(tmp_path / "h.json")
    report, updates = replay_here(tmp_path / "h.json", header, [H100], equal_for=1)
    assert not report["equal"] and report["first_difference"] == 1 and len(updates) == 2


def test_a_history_that_differs_in_more_than_its_device_is_refused(tmp_path, replay_here):
    header = write_history(tmp_path / "h.json")
    with pytest.raises(stage.HistoryMismatch, match="more than its device model: base_digests"):
        replay_here(tmp_path / "h.json", header, [H100], equal_for=3, base_digests=["another base"])


def test_without_a_history_it_says_what_it_needs():
    with pytest.raises(stage.ConfigError, match="--history=FILE is required"):
        noise_across_devices.main([])


@pytest.fixture
def same_noise_file(tmp_path, monkeypatch):
    path = tmp_path / "same_noise.json"
    monkeypatch.setattr(history, "SAME_NOISE_FILE", path)
    return path


def test_record_writes_an_equal_pair_and_the_stages_then_accept_the_history(tmp_path, replay_here, same_noise_file):
    header = write_history(tmp_path / "h.json")
    assert history.device_differences([H200], [H100])  # before: refused
    replay_here(tmp_path / "h.json", header, [H100], equal_for=3, argv=["--record=1"])
    (entry,) = json.loads(same_noise_file.read_text())
    assert entry["models"] == [["NVIDIA H100 80GB HBM3", 132], ["NVIDIA H200", 132]]
    assert entry["evidence"][0]["generations"] == 3 and entry["evidence"][0]["history"] == "h.json"
    assert history.device_differences([H200], [H100]) == [] and history.device_differences([H100], [H200]) == []
    assert history.device_differences([H200], [dict(H100, sm_count=114)])  # another model still refused


def test_record_writes_nothing_where_a_digest_differs_or_without_the_option(tmp_path, replay_here, same_noise_file):
    header = write_history(tmp_path / "h.json")
    replay_here(tmp_path / "h.json", header, [H100], equal_for=2, argv=["--record=1"])
    replay_here(tmp_path / "h.json", header, [H100], equal_for=3)
    assert not same_noise_file.exists()


def test_a_third_model_joins_the_group_of_the_model_it_matched(tmp_path, replay_here, same_noise_file):
    header = write_history(tmp_path / "h.json")
    h20 = {"name": "NVIDIA H20", "sm_count": 78}
    replay_here(tmp_path / "h.json", header, [H100], equal_for=3, argv=["--record=1"])
    replay_here(tmp_path / "h.json", header, [h20], equal_for=3, argv=["--record=1"])
    (entry,) = json.loads(same_noise_file.read_text())
    assert len(entry["models"]) == 3 and len(entry["evidence"]) == 2
    assert history.device_differences([H100], [h20]) == []
