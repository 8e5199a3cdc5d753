"""A scorer that fails stops the stage (docs/scoring.md): the warm-up on known answers (real workers, and stand-in
worker scripts that cannot start, die on every call or score wrongly, put where scoring.py looks its script up), the
bound on the episodes a scorer may fail on, and the training and evaluation stages stopped by either with one line
and nothing of the generation or set written."""

import asyncio
import importlib
import json
import textwrap

import pytest

import common
from agentic_es import data, engine, fileio, models, scoring, stage
from agentic_es.history import HISTORY_FILE
from conftest import REPO

train = importlib.import_module("01_train")
ONE_RANK = "--tensor_parallel_size=1"  # the stages' replies are scripted: the engine only has to run

# stand-ins for `python agentic_es/scoring.py PARENT_PID`
EXITS = "import sys; sys.exit(3)"
NEVER_READY = "import time; time.sleep(60)"
DIES_ON_EVERY_CALL = """
    import sys
    print('"ready"', flush=True)
    sys.stdin.readline()
"""
SCORES_EVERYTHING_0 = """
    import sys
    print('"ready"', flush=True)
    for line in sys.stdin:
        print('[0.0, "no_match"]', flush=True)
"""
SCORES_EVERYTHING_1 = f"""
    import sys
    sys.path.insert(0, {str(REPO)!r})
    from agentic_es import scoring
    scoring.score_answer = lambda prediction, gold: (1.0, "stand-in")  # where the worker looks it up
    scoring._scorer_worker_main(int(sys.argv[1]))
"""
WITHOUT_MATH_VERIFY = f"""
    import sys
    sys.path.insert(0, {str(REPO)!r})
    sys.modules["math_verify"] = None  # import math_verify fails
    from agentic_es import scoring
    scoring._scorer_worker_main(int(sys.argv[1]))
"""
PASSES_THE_WARM_UP_THEN_DIES = f"""
    import json, os, sys
    sys.path.insert(0, {str(REPO)!r})
    from agentic_es import scoring
    known = {{(prediction, gold): score for prediction, gold, score in scoring.WARM_UP_ANSWERS}}
    print('"ready"', flush=True)
    for line in sys.stdin:
        prediction, gold = json.loads(line)
        if (prediction, gold) not in known:
            os._exit(1)
        print(json.dumps([known[prediction, gold], "known"]), flush=True)
"""


@pytest.fixture
def scorer_script(tmp_path, monkeypatch):
    """Workers run the given script in place of scoring.py, in a new pool; the pool is shut down afterwards."""
    def use(text):
        script = tmp_path / "scorer_stand_in.py"
        script.write_text(textwrap.dedent(text))
        monkeypatch.setattr(scoring, "_SCORER_SCRIPT", str(script))
        scoring.shutdown_scorer_pool()
        return script

    yield use
    scoring.shutdown_scorer_pool()


def test_the_warm_up_checks_a_real_worker_once_and_keeps_it_for_the_episodes():
    scoring.shutdown_scorer_pool()
    try:
        stage.check_scorer()
        (worker,) = scoring._scorer_pool().workers()
        assert worker.ready and worker.process.poll() is None
        stage.check_scorer()  # checked: nothing more starts
        assert asyncio.run(scoring.score_answer_isolated("42", "42")) == (1.0, "integer_match")
        assert scoring._scorer_pool().workers() == [worker]
    finally:
        scoring.shutdown_scorer_pool()


@pytest.mark.parametrize("script, says", [
    (EXITS, r"a scorer worker \(\S+ \S+scorer_stand_in.py\) ended before it was ready \(exit status 3\)$"),
    (NEVER_READY, r"a scorer worker \(.*\) was not ready within 1 s$"),
    (DIES_ON_EVERY_CALL, r"a scorer worker ended while scoring the known answer '\\\\frac\{1\}\{2\}'$"),
    (SCORES_EVERYTHING_0, r"a scorer worker gave a wrong score: the known answer '\\\\frac\{1\}\{2\}' against the "
                          r"gold '0.5' scored 0 \(no_match\), not 1$"),
    (SCORES_EVERYTHING_1, r"failed its warm-up: the known answer '41' against the gold '42' scored 1 \(stand-in\), "
                          r"not 0$"),
    (WITHOUT_MATH_VERIFY, r"failed its warm-up: scoring '2\^\{10\}' raised ModuleNotFoundError: import of "
                          r"math_verify halted; None in sys.modules$"),
])
def test_a_scorer_that_cannot_start_or_scores_known_answers_wrongly_fails_the_warm_up(scorer_script, monkeypatch,
                                                                                      script, says):
    monkeypatch.setattr(scoring, "SCORER_START_TIMEOUT_S", 1.0)
    scorer_script(script)
    with pytest.raises(stage.ScorerFailure, match="^the answer scorer does not work, so every answer would score 0: "
                                                  f".*{says}") as failure:
        stage.check_scorer()
    assert "\n" not in str(failure.value)
    pool = scoring._scorer_pool()
    assert not pool.checked and pool.workers() == []  # the failed worker is killed, none waits for work
    with pytest.raises(stage.ScorerFailure):  # checked again on the next call
        stage.check_scorer()


def records(methods):
    return [{"score": 0.0, "score_method": method} for method in methods]


def test_the_stage_stops_past_5_percent_of_episodes_the_scorer_failed_on():
    assert stage.SCORER_FAILURE_BOUND == 0.05
    within = records(["score_error"] + ["no_match"] * 19)  # 1 of 20: 5%
    assert stage.check_scorer_failures(within, "generation 3", "-") == {"score_error": 1, "score_timeout": 0}
    assert stage.check_scorer_failures(records(["integer_match"] * 3), "generation 3", "-") == {
        "score_error": 0, "score_timeout": 0}
    past = records(["score_error", "score_timeout"] + ["no_match"] * 18)  # 2 of 20: 10%
    with pytest.raises(stage.ScorerFailure, match=r"^generation 3: the scorer failed on 2 of 20 episodes \(score_error "
                                                  r"1, score_timeout 1\), more than 5%: nothing is written$"):
        stage.check_scorer_failures(past, "generation 3", "nothing is written")


def slow_on_first_answers(marker, answers: int) -> str:
    """A stand-in worker whose first `answers` answers of the whole pool (counted in `marker`) take a minute."""
    return f"""
    import os, sys, time
    print('"ready"', flush=True)
    for line in sys.stdin:
        with open({str(marker)!r}, "a") as f:
            f.write("x")
        if os.path.getsize({str(marker)!r}) <= {answers}:
            time.sleep(60)
        print('[1.0, "stand-in"]', flush=True)
"""


def test_an_answer_past_the_limit_is_scored_again_and_a_second_timeout_is_the_models(scorer_script, monkeypatch,
                                                                                    tmp_path):
    """A worker that gives no score within SCORE_TIMEOUT_S is killed and the answer scored again in a fresh worker
    with SCORE_RETRY_FACTOR times the limit: a machine's stall costs no score; an answer that keeps that worker busy
    too scores 0 as the model's (answer_timeout), which the bound on the scorer's failures does not count, and
    which counts in a member's fitness."""
    monkeypatch.setattr(scoring, "SCORE_TIMEOUT_S", 1.0)
    monkeypatch.setattr(scoring, "SCORE_RETRY_FACTOR", 2.0)
    scorer_script(slow_on_first_answers(tmp_path / "answers", 1))
    assert asyncio.run(scoring.score_answer_isolated("42", "42")) == (1.0, "stand-in")  # the fresh worker's score
    assert len(scoring._scorer_pool().workers()) == 1  # the stalled one killed, the fresh one kept
    scorer_script(slow_on_first_answers(tmp_path / "twice", 2))
    assert asyncio.run(scoring.score_answer_isolated("2^{2001^{2000}}", "1")) == (0.0, "answer_timeout")
    assert "answer_timeout" not in stage.SCORER_FAILURES
    timed_out = records(["answer_timeout"] * 20)
    assert stage.check_scorer_failures(timed_out, "generation 3", "-") == {"score_error": 0, "score_timeout": 0}
    assert common.fitness(timed_out, "agent") == 0.0


def test_a_scorer_failure_within_the_bound_is_left_out_of_the_members_fitness():
    """An answer the scorer gave no score for (score_error, score_timeout) says nothing of the member: its fitness
    is the mean of the episodes that scored, not a 0 that biases z against it; a member with none has no fitness."""
    scored = [dict(r, score=1.0) for r in records(["integer_match"] * 3)]
    assert common.fitness(scored + records(["score_error"]), "agent") == 1.0
    assert common.fitness(scored + records(["score_timeout"]), "shaped") == 1.0
    with pytest.raises(stage.ScorerFailure, match="the scorer failed on all 2 episodes of a member"):
        common.fitness(records(["score_error", "score_timeout"]), "agent")


@pytest.mark.parametrize("script", [EXITS, DIES_ON_EVERY_CALL])
@pytest.mark.parametrize("stage_script, name", [("01_train.py", "train"), ("03_eval.py", "eval")])
def test_a_broken_scorer_stops_training_and_evaluation_before_their_engines_start(scorer_script, stage, tmp_path,
                                                                                  script, stage_script, name):
    """No engine starts (an unmarked test that starts one fails), nothing is written to the run folder."""
    models.resolve_model("tiny-qwen3-dense")  # written once beforehand: its build's notes are not the stage's
    scorer_script(script)
    run_dir = tmp_path / "run"
    proc = stage(stage_script, "--preset=smoke", f"--run_dir={run_dir}", *(["--export="] if name == "eval" else []))
    assert proc.returncode == 1
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"[{name}] error: the answer scorer does not work, so every answer would score 0: a "
                           "scorer worker ")
    assert not run_dir.exists() or list(run_dir.iterdir()) == []


# ---- the bound, on the stages' real engines: a scorer that passes the warm-up, then dies on every answer

def scripted_replies(monkeypatch):
    """Every episode calls the tool, then answers its problem's gold: each one reaches the scorer. The engine still
    generates every turn (Engine._policy), the script replaces its text."""
    problems = data.problems_from("smoke", common.Config.run_seed)
    generate = engine.Engine._policy

    async def policy(self, messages, *, seed, max_tokens):
        reply = await generate(self, messages, seed=seed, max_tokens=max_tokens)
        gold = next(p["answer"] for p in problems if p["question"] in messages[1]["content"])
        text = (json.dumps({"name": "bash", "arguments": {"command": f"echo {gold}"}}) if len(messages) == 2
                else f"Final answer: \\boxed{{{gold}}}")
        return dict(reply, text=text)

    monkeypatch.setattr(engine.Engine, "_policy", policy)


@pytest.mark.engine
def test_a_generation_the_scorer_failed_on_is_not_written(scorer_script, stage, monkeypatch, tmp_path):
    """The scorer works for generation 0 and breaks before generation 1 (the pool's workers replaced)."""
    scripted_replies(monkeypatch)
    run_generation = train.run_generation

    def then_break_the_scorer(*args, **kwargs):
        record = run_generation(*args, **kwargs)
        scorer_script(PASSES_THE_WARM_UP_THEN_DIES)
        return record

    monkeypatch.setattr(train, "run_generation", then_break_the_scorer)
    scoring.shutdown_scorer_pool()
    run_dir = tmp_path / "run"
    proc = stage("01_train.py", "--preset=smoke", ONE_RANK, f"--run_dir={run_dir}")  # 2 generations
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "[train] error: generation 1: the scorer failed on 8 of 8 episodes (score_error 8, score_timeout 0), more "
        "than 5%: nothing of generation 1 is written (docs/scoring.md)")
    history = fileio.read_json(run_dir / HISTORY_FILE)
    (generation,) = history["generations"]
    assert generation["rewards"] == [1.0] * 4  # every answer of generation 0 scored, and right
    # 01_train.py with the agent's score: equal rewards give z = 0, and the weights stay where they were
    assert generation["z"] == [0.0] * 4 and generation["digests"] == history["base_digests"]
    assert generation["scorer_failures"] == {"score_error": 0, "score_timeout": 0}
    assert not (run_dir / train.ROLLOUTS / "generation-001.jsonl").exists()


@pytest.mark.engine
def test_a_set_the_scorer_failed_on_is_not_counted_as_done(scorer_script, stage, monkeypatch, tmp_path):
    scripted_replies(monkeypatch)
    scorer_script(PASSES_THE_WARM_UP_THEN_DIES)
    run_dir = tmp_path / "run"
    proc = stage("03_eval.py", "--preset=smoke", ONE_RANK, f"--run_dir={run_dir}", "--export=", "--eval_problems=1")
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    out = run_dir / "eval-base"
    assert proc.stderr.strip().splitlines()[-1] == (
        "[eval] error: dapo: the scorer failed on 16 of 16 episodes (score_error 16, score_timeout 0), more than 5%: "
        f"the 16 episodes it failed on are not done ({out / 'dapo_episodes.jsonl'} keeps the others; "
        "docs/scoring.md)")
    assert not (out / "dapo_episodes.jsonl").exists()  # none is done: a resume runs them all
    assert not (out / "dapo_eval16.json").exists() and not (out / "metrics.json").exists()
