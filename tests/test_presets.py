"""The learn and strict presets through the four stages (their main() in this process), on the tiny random Qwen3 at
TP=2 with budgets cut to a CPU's. The two presets differ from the reference's settings in two things, the fitness
(learn: the shaped one) and the task's tier (strict: learn_digits); one flow checks both, so that the four stages
run once, not once per preset: `--preset=learn` with the strict preset's tier (the CPU-sized budgets make it
`--preset=strict --fitness=shaped`). The run scores its members with the learn preset's fitness, records it and
moves the weights, on the strict preset's tier; the evaluation is of that tier's held-out additions, with the
shaped reward beside Mean4/Pass4; export, evaluation and replay agree by digests. The strict preset's own settings
(the agent's score on its tier) are checked as parsed; a run of the agent's fitness through the four stages:
test_pipeline.py.

A random model earns no shaped reward (learn_task.shaped_reward, tested on real episodes in test_agent_loop.py), so
here the shaped entry of common.EPISODE_REWARDS, where common.fitness looks it up, is the test reward that varies
across members (train_with_test_reward.py), and the agent's entry stays the agent's score."""

import importlib

import pytest

import common
from agentic_es import cli, data, fileio, learn_task, settings
from agentic_es.export import SHARDED_STATE_MANIFEST
from agentic_es.history import HISTORY_FILE
from agentic_es.metrics import EVAL_SAMPLES
from train_with_test_reward import first_reply_variety

train = importlib.import_module("01_train")
export = importlib.import_module("02_export")
evaluation = importlib.import_module("03_eval")
replay = importlib.import_module("04_replay")

STRICT = settings.PRESETS["strict"]
TIER = STRICT["learn_digits"]
CPU_SIZED = ["--model=tiny-qwen3-dense", "--generations=1", "--population=4", "--case_batch=2", "--max_turns=2",
             "--max_new_tokens=32", "--eval_problems=1"]
ARGV = ["--preset=learn", f"--learn_digits={TIER}", *CPU_SIZED]  # the learn preset on the strict preset's tier
SET = "learn_heldout"


def run_four_stages(run_dir, argv, fitness):
    """The four stages' main() in order on the tiny model, the fitness's reward the test reward: (history, metrics,
    replay report)."""
    argv = [*argv, f"--run_dir={run_dir}"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(common.EPISODE_REWARDS, fitness, first_reply_variety)
        history = train.main(argv)
        export.main(argv)
        return history, evaluation.main(argv), replay.main(argv)


# slow: the four stages, an engine each: both presets' one flow
@pytest.fixture(scope="module")
def preset_run(tmp_path_factory):
    """The one flow of both presets (four engine starts)."""
    run_dir = tmp_path_factory.mktemp("presets") / "run"
    return run_dir, *run_four_stages(run_dir, ARGV, "shaped")


def test_the_two_presets_differ_in_the_fitness_and_the_tier_the_flow_combines():
    """What each preset sets (the flow below runs the learn preset's fitness on the strict preset's tier)."""
    strict, learn = cli.parse_config(["--preset=strict"]), cli.parse_config(["--preset=learn"])
    assert (strict.fitness, strict.train_data, strict.model) == ("agent", "learn", "qwen2.5-coder-1.5b")
    assert strict.learn_digits == TIER >= learn_task.LEARN_DIGITS_MIN
    assert (learn.fitness, learn.train_data, learn.learn_digits) == ("shaped", "learn", 0)
    assert settings.PRESETS["learn"]["fitness"] == "shaped" and "learn_digits" not in settings.PRESETS["learn"]
    flow = cli.parse_config([*ARGV, "--run_dir=run"])
    as_strict = cli.parse_config(["--preset=strict", "--fitness=shaped", *CPU_SIZED, "--max_model_len=2048",
                                  "--run_dir=run"])
    assert flow == as_strict  # the flow is either preset with the other's difference


@pytest.mark.engine  # the flow's four stages run vLLM engines (pytest.ini)
def test_the_members_are_scored_with_the_learn_preset_s_fitness_on_the_strict_preset_s_tier(preset_run):
    run_dir, history, _, _ = preset_run
    config = history["config"]
    assert (config["fitness"], config["train_data"], config["learn_digits"]) == ("shaped", "learn", TIER)
    assert history["reward"] == common.reward_definition("shaped")
    (generation,) = history["generations"]
    episodes = fileio.read_jsonl(run_dir / train.ROLLOUTS / "generation-000.jsonl")
    tier = {p["id"]: p for p in data.problems_from("learn", 0, TIER)}
    assert {e["problem_id"] for e in episodes} <= set(tier) and all(e["gold"] == tier[e["problem_id"]]["answer"]
                                                                     for e in episodes)
    by_member = [[e for e in episodes if e["member"] == m] for m in range(4)]
    assert all(len(records) == 2 for records in by_member)
    assert generation["rewards"] == [sum(map(first_reply_variety, records)) / 2 for records in by_member]
    assert [common.fitness(records, "agent") for records in by_member] == [0.0] * 4  # the agent's: z = 0
    assert any(z != 0 for z in generation["z"]) and generation["digests"] != history["base_digests"]


@pytest.mark.engine
def test_export_evaluation_and_replay_hold_the_trained_weights(preset_run):
    run_dir, history, metrics, replayed = preset_run
    trained = history["generations"][-1]["digests"]
    manifest = fileio.read_json(run_dir / "export" / SHARDED_STATE_MANIFEST)
    assert manifest["per_rank_digests"] == trained and manifest["config"]["fitness"] == "shaped"
    assert manifest["config"]["learn_digits"] == TIER
    assert metrics["checkpoint"]["per_rank_digests"] == trained and metrics["checkpoint"]["kind"] == "export"
    assert replayed["per_rank_digests"] == trained and replayed["replayed_generations"] == 1
    compared = replayed["datasets"][SET]
    assert compared["sample_agreement"] == 1.0 and compared["identical_transcripts"] == 1.0
    assert compared["original"] == compared["replayed"] and compared["fitness"] == "shaped"


@pytest.mark.engine
def test_the_evaluation_is_of_the_tier_s_held_out_additions_with_the_shaped_reward_beside_mean4(preset_run):
    run_dir, _, metrics, _ = preset_run
    assert list(metrics["datasets"]) == [SET]
    episodes = fileio.read_jsonl(run_dir / "eval" / f"{SET}_episodes.jsonl")
    (problem,) = data.problems_from(SET, 0, TIER)[:1]  # the preset's eval_problems, here cut to 1
    assert {e["problem_id"] for e in episodes} == {problem["id"]} and len(episodes) == EVAL_SAMPLES
    assert problem["question"] not in {p["question"] for p in data.problems_from("learn", 0, TIER)}
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


@pytest.mark.engine
def test_a_history_written_before_the_fitness_setting_resumes_as_its_rewards_tell(preset_run, tmp_path):
    """No engine starts: the finished run's history without its fitness (as bench/learning.py's were written before
    the setting) reads as the shaped reward its rewards tell (no whole number of episodes over the case batch): taken
    as finished under the preset's shaped fitness, refused under the agent's (the setting and the reading named)."""
    run_dir, history, _, _ = preset_run
    older = tmp_path / "run"
    older.mkdir()
    fileio.write_json_atomic(dict(history, config={k: v for k, v in history["config"].items() if k != "fitness"}),
                             older / HISTORY_FILE)
    argv = [*ARGV, f"--run_dir={older}"]
    with pytest.raises(common.HistoryMismatch, match=r"config fitness: history has 'shaped' \(the history predates "
                                                     r"the setting: read from its rewards, not each a whole number"):
        train.main([*argv, "--fitness=agent"])
    assert train.main(argv)["generations"] == history["generations"]
