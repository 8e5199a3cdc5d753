"""The strict preset through the four stages as `--preset=strict` runs them (their main() in this process, one run
shared by the module), with test_learn_preset.py's CPU-sized budgets on the tiny random Qwen3 at TP=2: the members
are scored with the agent's own score (--fitness=agent) on the preset's tier of the learn task (learn_digits), the
evaluation is of that tier's held-out additions, and export, evaluation and replay agree by digests. A random model
never scores, so the agent's entry of common.EPISODE_REWARDS, where common.fitness looks it up, is the test reward
that varies across members (train_with_test_reward.py), as in test_pipeline.py."""

import importlib

import pytest

import common
from agentic_es import cli, data, fileio, learn_task, settings
from agentic_es.export import SHARDED_STATE_MANIFEST
from agentic_es.metrics import EVAL_SAMPLES
from test_learn_preset import SET, run_four_stages
from train_with_test_reward import first_reply_variety

pytestmark = pytest.mark.engine  # the four stages run vLLM engines (pytest.ini)

train = importlib.import_module("01_train")
PRESET = settings.PRESETS["strict"]


@pytest.fixture(scope="module")
def strict_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("strict") / "run"
    return run_dir, *run_four_stages(run_dir, "strict", "agent")


def test_the_preset_trains_on_the_strict_score_of_a_tier_of_the_learn_task():
    cfg = cli.parse_config(["--preset=strict"])
    assert (cfg.fitness, cfg.train_data, cfg.model) == ("agent", "learn", "qwen2.5-coder-1.5b")
    assert cfg.learn_digits == PRESET["learn_digits"] >= learn_task.LEARN_DIGITS_MIN
    assert settings.PRESETS["learn"]["fitness"] == "shaped" and "learn_digits" not in settings.PRESETS["learn"]


def test_the_members_are_scored_with_the_agent_s_score_on_the_preset_s_tier(strict_run):
    run_dir, history, _, _ = strict_run
    config = history["config"]
    assert (config["fitness"], config["train_data"], config["learn_digits"]) == ("agent", "learn",
                                                                                PRESET["learn_digits"])
    (generation,) = history["generations"]
    episodes = fileio.read_jsonl(run_dir / train.ROLLOUTS / "generation-000.jsonl")
    tier = {p["id"]: p for p in data.problems_from("learn", 0, PRESET["learn_digits"])}
    assert {e["problem_id"] for e in episodes} <= set(tier) and all(e["gold"] == tier[e["problem_id"]]["answer"]
                                                                     for e in episodes)
    by_member = [[e for e in episodes if e["member"] == m] for m in range(4)]
    assert generation["rewards"] == [sum(map(first_reply_variety, records)) / 2 for records in by_member]
    assert any(z != 0 for z in generation["z"]) and generation["digests"] != history["base_digests"]


def test_export_evaluation_and_replay_hold_the_trained_weights_on_the_tier_s_held_out_additions(strict_run):
    run_dir, history, metrics, replayed = strict_run
    trained = history["generations"][-1]["digests"]
    manifest = fileio.read_json(run_dir / "export" / SHARDED_STATE_MANIFEST)
    assert manifest["per_rank_digests"] == trained and manifest["config"]["learn_digits"] == PRESET["learn_digits"]
    assert metrics["checkpoint"]["per_rank_digests"] == trained and list(metrics["datasets"]) == [SET]
    (problem,) = data.problems_from(SET, 0, PRESET["learn_digits"])[:1]  # the preset's eval_problems, cut to 1
    episodes = fileio.read_jsonl(run_dir / "eval" / f"{SET}_episodes.jsonl")
    assert {e["problem_id"] for e in episodes} == {problem["id"]} and len(episodes) == EVAL_SAMPLES
    assert replayed["per_rank_digests"] == trained and replayed["replayed_generations"] == 1
    compared = replayed["datasets"][SET]
    assert compared["sample_agreement"] == 1.0 and compared["identical_transcripts"] == 1.0
