"""The compute preset through the four stages as `--preset=compute` runs them (their main() in this process, one run
shared by the module), on the tiny random Qwen3 at TP=1, the preset's one-GPU setting (runs/compute_one_gpu.sh;
the four stages at TP=2: test_presets.py, test_pipeline.py), with budgets below test_presets.py's (2 members, one
problem, one turn): the members are scored with the agent's own score on the compute task's training problems of
the level the run sets (2 here); the evaluation, run without --compute_level, takes that level from the export's
history and evaluates both held-out sets of it; export, evaluation and replay agree by digests. A random model never
scores, so the agent's entry of common.EPISODE_REWARDS is the test reward that varies across members
(train_with_test_reward.py), as in test_presets.py."""

import pytest

import common
from agentic_es import compute_task, data, fileio
from agentic_es.export import SHARDED_STATE_MANIFEST
from agentic_es.metrics import EVAL_SAMPLES
from test_presets import evaluation, export, replay, train
from train_with_test_reward import first_reply_variety

pytestmark = pytest.mark.engine  # the four stages run vLLM engines (pytest.ini)

LEVEL = 2  # not the preset's: the evaluation must take it from the run's history
TINY = ["--preset=compute", "--tensor_parallel_size=1", "--model=tiny-qwen3-dense", "--max_model_len=2048",
        "--generations=1", "--population=2", "--case_batch=1", "--max_turns=1", "--max_new_tokens=16",
        "--eval_problems=1"]
SETS = ["compute_heldout", "compute_families"]


@pytest.fixture(scope="module")
def compute_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("compute") / "run"
    argv = [*TINY, f"--run_dir={run_dir}"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(common.EPISODE_REWARDS, "agent", first_reply_variety)
        history = train.main(argv + [f"--compute_level={LEVEL}"])
        export.main(argv)
        return run_dir, history, evaluation.main(argv), replay.main(argv)


def test_the_members_are_scored_on_the_level_s_training_problems(compute_run):
    run_dir, history, _, _ = compute_run
    config = history["config"]
    assert (config["fitness"], config["train_data"], config["compute_level"]) == ("agent", "compute", LEVEL)
    assert history["train_data_sha256"] == data.problems_sha256("compute", 0, compute_level=LEVEL)
    (generation,) = history["generations"]
    episodes = fileio.read_jsonl(run_dir / train.ROLLOUTS / "generation-000.jsonl")
    training = {p["id"]: p for p in compute_task.problems("train", LEVEL)}
    assert all(e["problem_id"] in training and e["gold"] == training[e["problem_id"]]["answer"] for e in episodes)
    assert generation["rewards"] == [first_reply_variety(e) for m in range(2) for e in episodes if e["member"] == m]
    assert any(z != 0 for z in generation["z"]) and generation["digests"] != history["base_digests"]


def test_export_evaluation_and_replay_hold_the_trained_weights_on_both_held_out_sets_of_the_level(compute_run):
    run_dir, history, metrics, replayed = compute_run
    trained = history["generations"][-1]["digests"]
    manifest = fileio.read_json(run_dir / "export" / SHARDED_STATE_MANIFEST)
    assert manifest["per_rank_digests"] == trained and manifest["config"]["compute_level"] == LEVEL
    assert metrics["checkpoint"]["per_rank_digests"] == trained and list(metrics["datasets"]) == SETS
    for name, split in zip(SETS, ("heldout", "families")):
        (problem,) = compute_task.problems(split, LEVEL, 1)  # the preset's eval_problems, cut to 1
        evaluated = fileio.read_json(run_dir / "eval" / f"{name}_eval16.json")
        assert evaluated["config"]["compute_level"] == LEVEL
        assert evaluated["data_sha256"] == data.problems_sha256(name, 0, compute_level=LEVEL)
        episodes = fileio.read_jsonl(run_dir / "eval" / f"{name}_episodes.jsonl")
        assert {e["problem_id"] for e in episodes} == {problem["id"]} and len(episodes) == EVAL_SAMPLES
        assert problem["question"].strip() in episodes[0]["messages"][1]["content"]  # the question, as worded
    assert replayed["per_rank_digests"] == trained and replayed["replayed_generations"] == 1
    for name in SETS:
        compared = replayed["datasets"][name]
        assert compared["sample_agreement"] == 1.0 and compared["identical_transcripts"] == 1.0
