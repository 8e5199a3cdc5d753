"""Failures of the engine and stops of the process (issue items 5, 6, 18): an engine failure stops the batch
instead of scoring 0, SIGTERM/SIGINT end the process with the conventional status. (vLLM's processes ending with a
dead engine, on a real one: test_agent_engine.py; the run-level checks, 01_train.py stopped and restarted:
test_pipeline.py.)"""

import asyncio
import json
import os
import subprocess
import sys

import pytest

import common
from agentic_es import sandbox, stage
from agentic_es.engine import Engine

PROBLEMS = [{"id": f"p{i}", "question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(3)]
BASH = json.dumps({"name": "bash", "arguments": {"command": "echo 2"}})


# ---- scripted policy: the episode loop's handling of an engine failure ----

def test_an_engine_failure_stops_the_batch_and_never_becomes_a_score():
    """p0 finishes, p1's second turn hits an engine failure while p2 waits on the engine: run_episodes raises the
    failure, p2 is cancelled, and only p0's record was reported."""
    never, p0_reported = asyncio.Event(), asyncio.Event()
    cancelled, calls, reported = [], [], []

    def progress(record):
        reported.append(record)
        p0_reported.set()

    async def policy(messages, *, seed, max_tokens):
        problem = next(p["id"] for p in PROBLEMS if p["question"] in messages[1]["content"])
        turn = sum(m["role"] == "assistant" for m in messages)
        calls.append((problem, turn))
        if problem == "p0":
            return {"text": BASH if turn == 0 else "Final answer: \\boxed{0}"}
        if problem == "p1" and turn == 1:
            await p0_reported.wait()
            raise stage.EngineFailure("vLLM failed during request x: EngineDeadError")
        if problem == "p1":
            return {"text": BASH}
        try:
            await never.wait()  # p2: a request that vLLM never answers
        except asyncio.CancelledError:
            cancelled.append(problem)
            raise

    with pytest.raises(stage.EngineFailure, match="EngineDeadError"):
        asyncio.run(common.run_episodes(policy, [(p, 0) for p in PROBLEMS], common.Config(bash_timeout_s=5),
                                        sandbox_check=sandbox.leak_check_result(), progress=progress))
    assert [(r["problem_id"], r["score"], r["error"]) for r in reported] == [("p0", 1.0, None)]
    assert cancelled == ["p2"] and ("p1", 1) in calls


def test_any_other_policy_error_is_an_episode_error_that_scores_zero():
    async def policy(messages, *, seed, max_tokens):
        raise ValueError("unparseable tokenizer output")

    record = asyncio.run(common.run_episode(policy, PROBLEMS[0], 0, common.Config(),
                                            sandbox_check=sandbox.leak_check_result()))
    assert (record["finish_reason"], record["score"]) == ("error", 0.0)
    assert record["error"] == "ValueError: unparseable tokenizer output"


def test_a_request_on_a_closed_engine_is_an_engine_failure_never_an_episode_error():
    """After SIGTERM with several engines, a pool thread may still ask an engine that is closing (or closed) for a
    reply: that is vLLM's failure (EngineFailure: the batch stops, no record), never an episode's error scored 0
    that 03_eval.py would keep as done on resume. So is a worker call on it."""
    closed = Engine.__new__(Engine)
    closed.llm, closed._closing = None, True  # as close() leaves it
    reported = []

    async def policy(messages, *, seed, max_tokens):
        if len(messages) == 2:
            return {"text": BASH}
        return {"text": (await closed._complete([1, 2, 3], None, "turn-1")).text}

    with pytest.raises(stage.EngineFailure, match="request turn-1: RuntimeError: the engine is closed"):
        asyncio.run(common.run_episodes(policy, [(PROBLEMS[0], 0)], common.Config(bash_timeout_s=5),
                                        sandbox_check=sandbox.leak_check_result(), progress=reported.append))
    assert reported == []
    with pytest.raises(stage.EngineFailure, match="the worker call es_digest: RuntimeError: the engine is closed"):
        closed.rpc(common.ESWorker.es_digest)


# ---- the scripts' signal handling and vLLM log level (a Python process without an engine) ----

SCRIPT = """
import common
import logging, os, signal, time
from agentic_es.stage import ConfigError, Interrupted, run_stage

def main(argv):
    print(os.environ.get("VLLM_LOGGING_LEVEL"), logging.getLogger("vllm").getEffectiveLevel(), flush=True)
    if argv[0] == "refuse":
        raise ConfigError("a refusal for its user")
    try:
        os.kill(os.getpid(), getattr(signal, argv[0]))
        time.sleep(60)
    except Interrupted as stop:
        print(stop, flush=True)
        raise

run_stage(main, "probe")
"""


@pytest.mark.parametrize("name, status", [("SIGTERM", 143), ("SIGINT", 130)])
def test_sigterm_and_sigint_raise_interrupted_and_exit_128_plus_signum(name, status):
    env = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_LEVEL"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, name], cwd=common.REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == status, proc.stderr[-3000:]
    level, stop = proc.stdout.splitlines()[:2]
    assert level == "ERROR 40" and stop == f"stopped by {name}"  # ERROR until an engine names its log file


def test_a_stage_error_ends_the_script_with_one_line_for_its_user():
    proc = subprocess.run([sys.executable, "-c", SCRIPT, "refuse"], cwd=common.REPO, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1 and proc.stderr.strip() == "[probe] error: a refusal for its user"


def test_the_users_vllm_log_level_wins():
    proc = subprocess.run([sys.executable, "-c", SCRIPT, "SIGTERM"], cwd=common.REPO, capture_output=True, text=True,
                          env=dict(os.environ, VLLM_LOGGING_LEVEL="DEBUG"), timeout=300)
    assert proc.stdout.splitlines()[0] == "DEBUG 10"


def test_the_users_vllm_logging_config_file_alone_wins(tmp_path):
    """VLLM_LOGGING_CONFIG_PATH without VLLM_LOGGING_LEVEL: the script reaches its try, and vLLM's logger is left
    to the user's file (which vLLM applies when an engine starts)."""
    config = tmp_path / "logging.json"
    config.write_text(json.dumps({"version": 1, "loggers": {"vllm": {"level": "DEBUG"}}}))
    env = {k: v for k, v in os.environ.items() if k != "VLLM_LOGGING_LEVEL"}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, "SIGTERM"], cwd=common.REPO, capture_output=True, text=True,
                          env=dict(env, VLLM_LOGGING_CONFIG_PATH=str(config)), timeout=300)
    assert proc.returncode == 143, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == ["None 30", "stopped by SIGTERM"]  # no level of ours on vLLM's logger
