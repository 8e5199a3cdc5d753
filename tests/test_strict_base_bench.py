"""bench/strict_base.py: the base model's strict score per tier. Its per-tier statistics on records made here
(the strict mean is the agent score's mean, its interval resamples problems, pass@K counts problems solved at least
once), the tiers it takes and refuses, and, with the tiny model on a real engine, a whole run: one row per tier,
every episode in the episodes file, each with the seed 03_eval.py gives that problem and sample."""

import json
import sys
from pathlib import Path

import pytest

import common
from agentic_es import cli, compute_task, data, fileio, stage

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import strict_base  # noqa: E402

CFG = cli.parse_config(["--preset=strict"])


def record(problem_id: str, score: float, bash_calls: int = 1) -> dict:
    messages = [{"role": "system", "content": ""}, {"role": "user", "content": "What is 1000 + 2000?"},
                {"role": "assistant", "content": "x"}]
    return {"problem_id": problem_id, "score": score, "bash_calls": bash_calls, "gold": "3000", "turns": 2,
            "finish_reason": "final_answer" if score else "max_turns",
            "score_method": "integer_match" if score else "missing_final_answer", "messages": messages}


def test_a_tier_s_row_is_the_mean_agent_score_with_an_interval_over_problems_and_pass_at_k():
    problems = [{"id": f"p{i}"} for i in range(4)]
    scores = {"p0": [1, 1], "p1": [1, 0], "p2": [0, 0], "p3": [0, 0]}  # 3 of 8 episodes, 2 of 4 problems
    records = [record(pid, s, bash_calls=int(pid != "p3")) for pid, ss in scores.items() for s in ss]
    row = strict_base.tier_row("4", problems, records, samples=2, seconds=1.0)
    assert row["strict"] == 3 / 8 and row["pass_at_k"] == 0.5 and row["bash_call_rate"] == 6 / 8
    assert 0 <= row["strict_ci"][0] < 3 / 8 < row["strict_ci"][1] <= 1
    assert row["finish"] == {"final_answer": 3, "max_turns": 5} and row["mean_turns"] == 2
    assert row["first_episode"] == records[0]["messages"][1:]
    table = strict_base.format_table([row]).splitlines()
    assert table[0].split()[:3] == ["tier", "N", "x"] and table[1].split()[:5] == ["4", "4", "x", "2", "0.375"]


def test_a_tier_is_a_learn_digits_value_s_held_out_additions_or_a_problems_file(tmp_path):
    assert strict_base.tier_problems("6", CFG, 5) == data.problems_from("learn_heldout", 0, 6)[:5]
    assert strict_base.tier_problems("0", CFG, 3) == data.problems_from("learn_heldout", 0)[:3]
    path = tmp_path / "set.jsonl"
    path.write_text(json.dumps({"id": "a", "question": "What is 2 + 2?", "answer": "4"}) + "\n")
    assert [p["id"] for p in strict_base.tier_problems(str(path), CFG, 5)] == ["a"]
    with pytest.raises(stage.ConfigError, match="^learn_digits=1 leaves too few pairs"):
        strict_base.tier_problems("1", CFG, 5)
    with pytest.raises(stage.DataError, match="problems file not found"):
        strict_base.tier_problems(str(tmp_path / "none.jsonl"), CFG, 5)


def test_a_compute_tier_is_a_level_s_held_out_problems():
    for level in (1, 2, 3):
        assert strict_base.tier_problems(f"compute{level}", CFG, 4) == compute_task.problems("heldout", level, 4)
    assert strict_base.tier_problems("compute_families2", CFG, 3) == compute_task.problems("families", 2, 3)
    compute = cli.parse_config(["--preset=strict", "--preset=compute"])  # the bench's overrides, as main reads them
    assert compute.train_data == "compute" and compute.max_new_tokens == 512
    assert strict_base.tier_problems("4", compute, 2) == data.problems_from("learn_heldout", 0, 4)[:2]
    with pytest.raises(stage.ConfigError, match=r"^compute_level must be in \[1, 3\]"):
        strict_base.tier_problems("compute4", CFG, 5)


REPO = Path(__file__).resolve().parents[1]


def test_the_strict_presets_documented_base_scores_are_its_gpu_reports():
    """docs/models.md says what bench/results/strict_base_h100.json measured: the base strict score on every tier,
    the preset's tier's, and the tool called on every tier, 2..19 included."""
    report = fileio.read_json(REPO / "bench" / "results" / "strict_base_h100.json")
    tiers = {row["tier"]: row for row in report["tiers"]}
    strict = [row["strict"] for row in tiers.values()]
    calls = [round(100 * row["bash_call_rate"]) for row in tiers.values()]
    text = " ".join((REPO / "docs" / "models.md").read_text().split())
    assert f"it is {min(strict):.2f}-{max(strict):.2f} on every tier measured" in text
    assert f"{tiers['4']['strict']:.3f} on tier 4" in text
    assert f"calls the tool in {min(calls)}-{max(calls)}% of the episodes on every tier, 2..19 included" in text
    assert tiers["0"]["bash_call_rate"] > 0.25 and "still to be made" not in text


class ScoredByABrokenScorer:
    """A read-only pool whose every episode the scorer failed on (score_error)."""

    def __init__(self, *args, **kwargs):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def run_agent(self, jobs, desc=None):
        return [dict(record(problem["id"], 0), score_method="score_error") for problem, _ in jobs]


def test_the_bench_checks_the_scorer_as_the_stages_do(tmp_path, monkeypatch):
    """A scorer that fails its warm-up stops the bench before its engines start; a tier whose episodes it failed on
    past the stages' bound (stage.SCORER_FAILURE_BOUND) stops it with that tier's row unwritten: a strict tier is
    never chosen from a broken scorer's 0s."""
    monkeypatch.setattr(common, "check_sandbox", lambda *args, **kwargs: [])
    monkeypatch.setattr(strict_base.models, "resolve_model", lambda name, *args, **kwargs: name)

    def broken():
        raise stage.ScorerFailure("the answer scorer does not work, so every answer would score 0: stand-in")

    def no_engine(*args, **kwargs):
        raise AssertionError("an engine started before the scorer was checked")

    argv = ["--tiers=3", "--problems=2", "--samples=2", f"--out={tmp_path / 'report.json'}"]
    monkeypatch.setattr(stage, "check_scorer", broken)
    monkeypatch.setattr(strict_base, "EnginePool", no_engine)
    with pytest.raises(stage.ScorerFailure, match="every answer would score 0"):
        strict_base.main(argv)
    monkeypatch.setattr(stage, "check_scorer", lambda: None)
    monkeypatch.setattr(strict_base, "EnginePool", ScoredByABrokenScorer)
    with pytest.raises(stage.ScorerFailure, match="^tier 3: the scorer failed on 4 of 4 episodes"):
        strict_base.main(argv)
    assert not (tmp_path / "report.json").exists()


@pytest.mark.engine
def test_a_run_on_the_tiny_model_reports_every_tier_and_keeps_every_episode(tmp_path):
    episodes = tmp_path / "episodes.jsonl"
    # at TP=1, as the bench runs on one GPU
    report = strict_base.main(["--model=tiny-qwen3-dense", "--tiers=3,smoke", "--problems=2", "--samples=2",
                               "--tensor_parallel_size=1", "--max_turns=1", "--max_new_tokens=16",
                               f"--run_dir={tmp_path / 'run'}", f"--out={tmp_path / 'report.json'}",
                               f"--episodes={episodes}"])
    assert fileio.read_json(tmp_path / "report.json") == json.loads(json.dumps(report))
    assert [(r["tier"], r["problems"], r["samples"]) for r in report["tiers"]] == [("3", 2, 2), ("smoke", 2, 2)]
    assert report["config"]["fitness"] == "agent" and report["model"] == "tiny-qwen3-dense"
    rows = fileio.read_jsonl(episodes)
    expected = [(p["id"], i) for tier, problems in (("3", data.problems_from("learn_heldout", 0, 3)[:2]),
                                                    ("smoke", data.problems_from("smoke", CFG.run_seed)[:2]))
                for p in problems for i in range(2)]
    assert [(r["problem_id"], r["sample_index"]) for r in rows] == expected
    assert all(r["seed"] == common.request_seed(CFG.run_seed, r["problem_id"], r["sample_index"], 0) for r in rows)
    assert all(r["score"] == 0 for r in rows)  # a random model never answers
