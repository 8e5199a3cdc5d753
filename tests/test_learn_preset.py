"""The learn preset through the four stages as `--preset=learn` runs them (their main() in this process, one run
shared by the module), on the tiny random Qwen3 at TP=2 with budgets cut to a CPU's: the run scores its members with
the fitness the preset names (the shaped one), records it, and moves the weights; the evaluation is of the learn
task's held-out additions, with that reward beside Mean4/Pass4; export, evaluation and replay agree by digests.
A random model earns no shaped reward (learn_task.shaped_reward, tested on real episodes in test_agent_loop.py), so here
the shaped entry of common.EPISODE_REWARDS, where common.fitness looks it up, is the test reward that varies across
members (train_with_test_reward.py), and the agent's entry stays the agent's score."""

import importlib

import pytest

import common
from agentic_es import data, fileio, learn_task, stage
from agentic_es.export import SHARDED_STATE_MANIFEST
from agentic_es.history import HISTORY_FILE
from agentic_es.metrics import EVAL_SAMPLES
from train_with_test_reward import first_reply_variety

pytestmark = pytest.mark.engine  # the four stages run vLLM engines (pytest.ini)

train = importlib.import_module("01_train")
export = importlib.import_module("02_export")
evaluation = importlib.import_module("03_eval")
replay = importlib.import_module("04_replay")

CPU_SIZED = ["--model=tiny-qwen3-dense", "--generations=1", "--population=4", "--case_batch=2", "--max_turns=2",
             "--max_new_tokens=32", "--eval_problems=1"]
SET = "learn_heldout"


def run_four_stages(run_dir, preset, fitness):
    """The preset's four stages' main() in order on the tiny model (CPU_SIZED), its fitness's reward the test
    reward: (history, metrics, replay report)."""
    argv = [f"--preset={preset}", *CPU_SIZED, f"--run_dir={run_dir}"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(common.EPISODE_REWARDS, fitness, first_reply_variety)
        history = train.main(argv)
        export.main(argv)
        return history, evaluation.main(argv), replay.main(argv)


@pytest.fixture(scope="module")
def learn_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("learn") / "run"
    return run_dir, *run_four_stages(run_dir, "learn", "shaped")


def test_the_members_are_scored_with_the_presets_fitness_which_moves_the_weights(learn_run):
    run_dir, history, _, _ = learn_run
    assert history["config"]["fitness"] == "shaped" and history["config"]["train_data"] == "learn"
    assert history["reward"] == common.reward_definition("shaped")
    (generation,) = history["generations"]
    episodes = fileio.read_jsonl(run_dir / train.ROLLOUTS / "generation-000.jsonl")
    by_member = [[e for e in episodes if e["member"] == m] for m in range(4)]
    assert all(len(records) == 2 for records in by_member)
    assert generation["rewards"] == [sum(map(first_reply_variety, records)) / 2 for records in by_member]
    assert [common.fitness(records, "agent") for records in by_member] == [0.0] * 4  # the agent's: z = 0
    assert any(z != 0 for z in generation["z"]) and generation["digests"] != history["base_digests"]


def test_export_evaluation_and_replay_hold_the_trained_weights(learn_run):
    run_dir, history, metrics, replayed = learn_run
    trained = history["generations"][-1]["digests"]
    manifest = fileio.read_json(run_dir / "export" / SHARDED_STATE_MANIFEST)
    assert manifest["per_rank_digests"] == trained and manifest["config"]["fitness"] == "shaped"
    assert metrics["checkpoint"]["per_rank_digests"] == trained and metrics["checkpoint"]["kind"] == "export"
    assert replayed["per_rank_digests"] == trained and replayed["replayed_generations"] == 1
    compared = replayed["datasets"][SET]
    assert compared["sample_agreement"] == 1.0 and compared["identical_transcripts"] == 1.0
    assert compared["original"] == compared["replayed"] and compared["fitness"] == "shaped"


def test_the_evaluation_is_of_held_out_additions_with_the_shaped_reward_beside_mean4(learn_run):
    run_dir, _, metrics, _ = learn_run
    assert list(metrics["datasets"]) == [SET]
    episodes = fileio.read_jsonl(run_dir / "eval" / f"{SET}_episodes.jsonl")
    (problem,) = data.problems_from(SET, 0)[:1]  # the preset's eval_problems, here cut to 1
    assert {e["problem_id"] for e in episodes} == {problem["id"]} and len(episodes) == EVAL_SAMPLES
    assert problem["question"] not in {p["question"] for p in data.problems_from("learn", 0)}
    by_sample = {e["sample_index"]: e for e in episodes}
    in_order = [by_sample[i] for i in range(EVAL_SAMPLES)]
    m = metrics["datasets"][SET]
    assert m["reward"] == {"fitness": "shaped", "mean_at_16": sum(map(first_reply_variety, in_order)) / 16}
    assert m["mean_at_16"] == common.fitness(in_order, "agent") and {"mean4", "pass4"} <= set(m["reported"])
    eval16 = fileio.read_json(run_dir / "eval" / f"{SET}_eval16.json")
    assert eval16["reward"] == common.reward_definition("shaped")  # how it scored them: a replay compares under it
    records = eval16["records"]
    assert [r["reward"] for r in records] == [first_reply_variety(by_sample[r["sample_index"]]) for r in records]
    header = evaluation.format_metrics_table(metrics["datasets"]).splitlines()[0]
    assert "Mean4@12-15" in header and "mean@16" in header and "shaped reward@16" in header


def test_a_history_written_before_the_fitness_setting_resumes_as_its_rewards_tell(learn_run, tmp_path):
    """No engine starts: the finished run's history without its fitness (as bench/learning.py's were written before
    the setting) reads as the shaped reward its rewards tell (no whole number of episodes over the case batch): taken
    as finished under the preset's shaped fitness, refused under the agent's (the setting and the reading named)."""
    run_dir, history, _, _ = learn_run
    older = tmp_path / "run"
    older.mkdir()
    fileio.write_json_atomic(dict(history, config={k: v for k, v in history["config"].items() if k != "fitness"}),
                             older / HISTORY_FILE)
    argv = ["--preset=learn", *CPU_SIZED, f"--run_dir={older}"]
    with pytest.raises(stage.HistoryMismatch, match=r"config fitness: history has 'shaped' \(the history predates "
                                                    r"the setting: read from its rewards, not each a whole number"):
        train.main([*argv, "--fitness=agent"])
    assert train.main(argv)["generations"] == history["generations"]
