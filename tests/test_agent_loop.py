"""The ReAct episode loop with a scripted policy instead of a model."""

import asyncio
import dataclasses
import importlib
import json
import os
import threading
import time

import pytest

import common
from agentic_es import data, learn_task, sandbox, scoring

evaluation = importlib.import_module("03_eval")  # writes the failed episodes' transcripts

PROBLEM = {"id": "p1", "question": "What is 6 times 7?", "answer": "42"}
RUN_SEED = 1234
SETTINGS = common.Config(run_seed=RUN_SEED)  # the agent loop's settings: the run's defaults


def action(command):
    return json.dumps({"name": "bash", "arguments": {"command": command}})


class ScriptedPolicy:
    """Replies from a script, in order; an exception in the script is raised instead. Records every call."""

    def __init__(self, script, delay_s=0.0):
        self.script, self.delay_s, self.calls = list(script), delay_s, []
        self.in_flight = self.max_in_flight = 0

    async def __call__(self, messages, *, seed, max_tokens):
        self.calls.append({"seed": seed, "max_tokens": max_tokens, "messages": [dict(m) for m in messages]})
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay_s)
        finally:
            self.in_flight -= 1
        reply = self.script.pop(0)
        if isinstance(reply, Exception):
            raise reply
        return {"text": reply, "prompt_tokens": 100 * len(messages), "completion_tokens": 7, "finish_reason": "stop"}


@pytest.fixture(scope="module", autouse=True)
def warm_scorer_pool():
    """Episodes score in worker processes; start two once, so that no episode here waits for a start-up."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(scoring, "SCORER_PROCESSES", 2)
        scoring.shutdown_scorer_pool()
        asyncio.run(_score_concurrently([("1", "1")] * 2))
        yield
        scoring.shutdown_scorer_pool()


async def _score_concurrently(pairs):
    return await asyncio.gather(*(scoring.score_answer_isolated(prediction, gold) for prediction, gold in pairs))


def run(policy, problem=PROBLEM, sample_index=0, **settings):
    """One episode under SETTINGS with these Config fields changed, in this process's sandbox."""
    cfg = dataclasses.replace(SETTINGS, **settings)
    return asyncio.run(common.run_episode(policy, problem, sample_index, cfg,
                                          sandbox_check=sandbox.leak_check_result()))


def run_many(policy, items, progress=None, **settings):
    """run_episodes under SETTINGS with these Config fields changed, in this process's sandbox."""
    cfg = dataclasses.replace(SETTINGS, **settings)
    return asyncio.run(common.run_episodes(policy, items, cfg, sandbox_check=sandbox.leak_check_result(),
                                           progress=progress))


def test_correct_answer_after_bash_scores(monkeypatch):
    sandbox.sandbox_kind()  # detect (and cache) the sandbox first: detection uses a work dir of its own
    workdirs = []
    make_workdir = sandbox.make_workdir
    monkeypatch.setattr(sandbox, "make_workdir", lambda: workdirs.append(make_workdir()) or workdirs[-1])
    policy = ScriptedPolicy([action("python3 -c 'print(6 * 7)'"), "It prints 42.\nFinal answer: \\boxed{42}"])
    record = run(policy)
    assert (record["score"], record["score_method"], record["prediction"]) == (1.0, "integer_match", "42")
    assert (record["turns"], record["bash_calls"], record["finish_reason"], record["error"]) == (2, 1, "final_answer", None)
    assert record["completion_tokens"] == 14 and record["prompt_tokens"] == 400  # sum, last
    assert record["seed"] == common.request_seed(RUN_SEED, "p1", 0, 0)
    assert record["sandbox"] == sandbox.sandbox_kind() and record["gold"] == "42"
    roles = [m["role"] for m in record["messages"]]
    assert roles == ["system", "user", "assistant", "user", "assistant"]
    assert record["messages"][0]["content"] == common.SYSTEM_PROMPT
    assert "What is 6 times 7?" in record["messages"][1]["content"]
    observation = record["messages"][3]["content"]
    assert "exit code: 0" in observation and "42" in observation
    assert len(workdirs) == 1 and not os.path.exists(workdirs[0])  # the work dir is gone afterwards
    json.dumps(record)  # records are plain JSON


def test_answer_before_bash_is_refused():
    policy = ScriptedPolicy(["Final answer: \\boxed{42}", action("echo 42"), "Final answer: \\boxed{42}"])
    record = run(policy)
    assert record["messages"][3] == {"role": "user", "content": common.ANSWER_BEFORE_BASH_MESSAGE}
    assert (record["turns"], record["bash_calls"], record["score"]) == (3, 1, 1.0)


def test_never_running_bash_never_scores():
    policy = ScriptedPolicy(["Final answer: \\boxed{42}"] * 3)
    record = run(policy, max_turns=3)
    assert record["score"] == 0.0 and record["bash_calls"] == 0 and record["finish_reason"] == "max_turns"
    assert [m["content"] for m in record["messages"][3::2]] == [common.ANSWER_BEFORE_BASH_MESSAGE] * 3


def test_blank_command_is_not_the_required_bash_call():
    blank = json.dumps({"name": "bash", "arguments": {"command": "  \n "}})
    policy = ScriptedPolicy([blank, "Final answer: \\boxed{42}", action("echo 42"), "Final answer: \\boxed{42}"])
    record = run(policy)
    assert record["messages"][3] == {"role": "user", "content": common.NO_ACTION_MESSAGE}
    assert record["messages"][5] == {"role": "user", "content": common.ANSWER_BEFORE_BASH_MESSAGE}
    assert (record["turns"], record["bash_calls"], record["score"]) == (4, 1, 1.0)


def test_answer_mentioned_mid_line_does_not_end_the_episode():
    policy = ScriptedPolicy([action("echo 16"), "I computed the answer: 16 earlier, let me double-check.",
                             action("echo 42"), "Checked.\nFinal answer: \\boxed{42}"])
    record = run(policy)
    assert record["messages"][5] == {"role": "user", "content": common.NO_ACTION_MESSAGE}
    assert (record["turns"], record["prediction"], record["score"]) == (4, "42", 1.0)


def test_no_action_gets_the_corrective_message():
    policy = ScriptedPolicy(["Let me think about it.", action("echo 42"), "Final answer: \\boxed{42}"])
    record = run(policy)
    assert record["messages"][3] == {"role": "user", "content": common.NO_ACTION_MESSAGE}
    assert record["score"] == 1.0 and record["turns"] == 3


def test_action_and_answer_in_one_reply_runs_the_action_only():
    policy = ScriptedPolicy([action("echo 41") + "\nFinal answer: \\boxed{41}", "Final answer: \\boxed{42}"])
    record = run(policy)
    assert record["bash_calls"] == 1 and record["turns"] == 2
    assert record["prediction"] == "42" and record["score"] == 1.0


def test_turn_limit():
    policy = ScriptedPolicy([action("echo hi")] * 3)
    record = run(policy, max_turns=3)
    assert (record["finish_reason"], record["turns"], record["bash_calls"]) == ("max_turns", 3, 3)
    assert (record["score"], record["score_method"], record["prediction"]) == (0.0, "missing_final_answer", None)
    assert len(policy.calls) == 3


def test_observation_is_truncated_head_and_tail():
    policy = ScriptedPolicy([action("python3 -c \"print('a' * 50000 + 'b' * 50000)\""), "Final answer: \\boxed{42}"])
    record = run(policy, observation_chars=1000)
    observation = record["messages"][3]["content"]
    assert len(observation) < 1100
    assert observation.startswith("exit code: 0\nstdout:\naaa")
    assert "bbbb\nstderr:\n(empty)" in observation  # the tail survives
    assert "characters cut ...]" in observation


def test_timeout_is_reported_to_the_model():
    policy = ScriptedPolicy([action("sleep 30"), "Final answer: \\boxed{42}"])
    started = time.monotonic()
    record = run(policy, bash_timeout_s=1)
    assert time.monotonic() - started < 20  # not the command's 30 s
    assert "timed out after 1 s" in record["messages"][3]["content"]


LEARN = learn_task.learn_problems(1, seed=7)[0]  # "What is A + B? First call the tool: ..."
A, B = learn_task.learn_operands(LEARN["question"])
SUM = LEARN["answer"]


@pytest.mark.parametrize("problem, replies, reward", [
    (LEARN, [action(f"python3 -c 'print({A} + {B})'"), f"Final answer: \\boxed{{{SUM}}}"], 1.0),  # the task, done
    (LEARN, [action(f"python3 -c 'print({A} + {B})'")], 0.5),                  # the question's sum, by the tool
    (LEARN, [action(f"echo $(({B}+{A}))")], 0.5),                              # either order, any tool
    (LEARN, [action(f"for i in $(seq 0 40); do [ $i -eq $(({A} + {B})) ] && echo $i; done; true")], 0.5),  # too
    (LEARN, [action(f"python3 -c 'print({A} - {B})'")], 0.25),                 # honest, but a wrong sum
    (LEARN, [action(f"python3 -c 'print({A} + {B})' >&2")], 0.25),             # stderr is not the output
    (LEARN, [action(f"python3 -c 'print({A} + {B})'; exit 3")], 0.25),         # a failed command's output
    (LEARN, [action(f"python3 -c 'print({A} + {B})'; sleep 30")], 0.25),       # a command killed at its time limit
    (PROBLEM, [action("python3 -c 'print(6 * 7)'")], 0.25),                    # not a learn question: no operands
    (LEARN, [f"So {A}+{B} is {SUM}."], 0.1),                                    # the right sum, in words, no spaces
    (LEARN, [f"{A} + {B} = {int(SUM) - 1}. No: {A} + {B} = {SUM}"], 0.0),       # only the first stated sum counts
    (LEARN, [f"{A} + {int(B) + 1} = {int(SUM) + 1}"], 0.0),                     # not the question's operands
    (LEARN, [f"{A} + {B} = {SUM}.5"], 0.0),                                     # not the sum
    (PROBLEM, ["6 * 7 = 42, and 40 + 2 = 42"], 0.0),                            # not an addition question
    (LEARN, [f"Final answer: \\boxed{{{SUM}}}"] * 3, 0.0),                     # an answer without the tool
])
def test_the_shaped_reward_credits_the_first_step_of_the_learn_task_an_episode_reached(problem, replies, reward):
    """learn_task.shaped_reward, each of its rules on episodes of the real loop and sandbox (then silence)."""
    record = run(ScriptedPolicy(replies + ["..."] * 3), problem, max_turns=3, bash_timeout_s=1)
    assert learn_task.shaped_reward(record) == common.EPISODE_REWARDS["shaped"](record) == reward
    assert common.agent_reward(record) == record["score"] == (reward == 1.0)
    silent = run(ScriptedPolicy(["..."] * 3), problem, max_turns=3)
    assert common.fitness([record, silent], "shaped") == reward / 2  # a member's fitness: the mean over episodes
    assert common.fitness([record, silent], "agent") == record["score"] / 2


OTHER_OPERANDS = (int(A) + 1, int(B) - 1)  # the same sum
assert sorted(map(str, OTHER_OPERANDS)) != sorted([A, B])


@pytest.mark.parametrize("command", [
    "seq 0 40",                                                   # every candidate, the gold among them
    "for i in $(seq 0 40); do echo $i; done",                     # a loop over the candidates
    f"echo {int(SUM) - 1} {SUM} {int(SUM) + 1}",                  # many numbers
    f"python3 -c 'print({A} + {B}, {A} + {B} + 1)'",              # the sum and another number
    f"python3 -c 'print({A} + {B}); print(\"stderr:\")'",         # the sum, then a false end of its stdout
    f"echo 'What is {A} + {B}?'; python3 -c 'print({A} + {B})'",  # the question echoed beside the sum
    f"echo {SUM}",                                                # the gold written in
    f"echo {SUM}  # {A} + {B}",                                   # ... beside the sum that would compute it
    f"python3 -c 'print({OTHER_OPERANDS[0]} + {OTHER_OPERANDS[1]})'",  # other operands of the same sum
])
def test_no_game_of_the_shaped_reward_earns_more_than_an_honest_wrong_sum(command):
    """Commands whose output holds the gold, but not as the tool's answer to the question's sum alone (the gold among
    other numbers or words, written in, or the sum of other operands): each earns what a bash call that computes a
    wrong sum earns."""
    game = run(ScriptedPolicy([action(command)] + ["..."] * 2), LEARN, max_turns=3)
    honest_but_wrong = run(ScriptedPolicy([action(f"python3 -c 'print({A} - {B})'")] + ["..."] * 2), LEARN,
                           max_turns=3)
    observation = game["messages"][3]["content"]
    assert observation.startswith("exit code: 0\nstdout:\n") and SUM in observation.split("stderr:")[0].split()
    assert learn_task.shaped_reward(game) == learn_task.shaped_reward(honest_but_wrong) == 0.25


def test_seeds_per_turn_and_sample():
    script = ["hmm", action("true"), "Final answer: \\boxed{42}"]
    first, second = ScriptedPolicy(script), ScriptedPolicy(script)
    run(first, sample_index=3, max_new_tokens=123)
    run(second, sample_index=4, max_new_tokens=123)
    seeds_3 = [c["seed"] for c in first.calls]
    seeds_4 = [c["seed"] for c in second.calls]
    assert seeds_3 == [common.request_seed(RUN_SEED, "p1", 3, turn) for turn in range(3)]
    assert seeds_4 == [common.request_seed(RUN_SEED, "p1", 4, turn) for turn in range(3)]
    assert len(set(seeds_3 + seeds_4)) == 6
    assert all(c["max_tokens"] == 123 for c in first.calls + second.calls)
    # the same request again gets the same seed: any sample can be re-run on its own
    again = ScriptedPolicy(script)
    run(again, sample_index=3, max_new_tokens=123)
    assert [c["seed"] for c in again.calls] == seeds_3


def test_context_overflow_ends_the_episode():
    policy = ScriptedPolicy([action("echo 42"), common.ContextOverflow("prompt 40961 > 40960 tokens")])
    record = run(policy)
    assert (record["finish_reason"], record["score"], record["score_method"]) == ("context_overflow", 0.0,
                                                                                 "context_overflow")
    assert "40961" in record["error"] and record["turns"] == 1 and record["bash_calls"] == 1


def test_policy_error_ends_the_episode_without_score():
    policy = ScriptedPolicy([action("echo 42"), RuntimeError("engine died")])
    record = run(policy)
    assert record["finish_reason"] == "error" and record["score"] == 0.0 and "engine died" in record["error"]


def test_run_episodes_is_concurrent_and_keeps_order(monkeypatch):
    n = 6
    bash = {"in_flight": 0, "max_in_flight": 0}
    lock, run_bash = threading.Lock(), sandbox.run_bash

    def counting_run_bash(*args, **kwargs):  # bash runs off the event loop: commands of different episodes overlap
        with lock:
            bash["in_flight"] += 1
            bash["max_in_flight"] = max(bash["max_in_flight"], bash["in_flight"])
        try:
            return run_bash(*args, **kwargs)
        finally:
            with lock:
                bash["in_flight"] -= 1

    monkeypatch.setattr(sandbox, "run_bash", counting_run_bash)
    # earlier episodes are slower, so they finish last: the returned order must still be the input order
    policies = {f"p{i}": ScriptedPolicy([action("sleep 0.5"), "Final answer: \\boxed{42}"], delay_s=0.1 * (n - i))
                for i in range(n)}
    shared = ScriptedPolicy([])

    async def policy(messages, *, seed, max_tokens):  # route by problem, count overlap across all episodes
        pid = messages[1]["content"].split("#")[1].split()[0]
        shared.in_flight += 1
        shared.max_in_flight = max(shared.max_in_flight, shared.in_flight)
        try:
            return await policies[pid](messages, seed=seed, max_tokens=max_tokens)
        finally:
            shared.in_flight -= 1

    items = [({"id": f"p{i}", "question": f"problem #p{i} ?", "answer": "42"}, i % 2) for i in range(n)]
    finished = []
    records = run_many(policy, items, progress=finished.append)
    assert shared.max_in_flight > 1 and bash["max_in_flight"] > 1  # model calls AND bash commands overlap
    assert [(r["problem_id"], r["sample_index"]) for r in records] == [(p["id"], s) for p, s in items]
    assert all(r["score"] == 1.0 for r in records)
    assert len(finished) == n and [r["problem_id"] for r in finished] != [r["problem_id"] for r in records]


def test_run_episodes_concurrency_limit():
    policy = ScriptedPolicy([action("true"), "Final answer: \\boxed{42}"] * 5, delay_s=0.05)

    async def in_order(messages, *, seed, max_tokens):  # one shared script: replies alternate action/answer
        return await policy(messages, seed=seed, max_tokens=max_tokens)

    run_many(in_order, [(PROBLEM, i) for i in range(5)], concurrency=1)
    assert policy.max_in_flight == 1


def test_each_reply_s_finish_reason_is_kept_in_turn_order():
    """A reply cut at max_tokens ("length") is told from one that ended ("stop"), in the record's
    reply_finish_reasons; the conversation itself stays as the model saw it (the replay compares it), and a policy
    that does not tell leaves None."""
    replies = iter([("Let me think about 6 times", "length"), (action("echo 42"), "stop"),
                    ("Final answer: \\boxed{42}", "stop")])

    async def policy(messages, *, seed, max_tokens):
        text, reason = next(replies)
        return {"text": text, "finish_reason": reason}

    record = run(policy)
    assert (record["reply_finish_reasons"], record["turns"], record["score"]) == (["length", "stop", "stop"], 3, 1.0)
    assert all(set(m) == {"role", "content"} for m in record["messages"])
    untold = run(lambda messages, **kw: asyncio.sleep(0, {"text": "no action"}), max_turns=2)
    assert untold["reply_finish_reasons"] == [None, None]


def test_the_failed_episodes_transcript_tells_each_reply_s_finish_reason(tmp_path):
    async def policy(messages, *, seed, max_tokens):
        return {"text": "6 times 7 is", "finish_reason": "length"}

    record = run(policy, max_turns=1)
    older = {k: v for k, v in record.items() if k != "reply_finish_reasons"}  # an episode log's older record
    evaluation.write_transcripts_markdown([record, older], tmp_path / "failed.md")
    text = (tmp_path / "failed.md").read_text()
    assert text.count("### 2. assistant (finish reason: length)") == 1 and text.count("### 2. assistant\n") == 1


def test_write_transcripts_markdown(tmp_path):
    good = run(ScriptedPolicy([action("echo 42"), "Final answer: \\boxed{42}"]))
    bad = run(ScriptedPolicy([action("echo ```weird```"), "Final answer: \\boxed{41}"]), sample_index=5)
    path = tmp_path / "failed.md"
    evaluation.write_transcripts_markdown([good, bad], path)
    text = path.read_text()
    assert "1 of 2" in text and "sample 5" in text and "sample 0" not in text
    assert "### 0. system" in text and "### 2. assistant" in text and "### 3. user" in text
    assert "````text" in text  # the fence outgrows the backticks inside the message


def test_a_hanging_answer_times_out_without_delaying_other_episodes(monkeypatch):
    # sympy alone runs for minutes on this answer, holding the GIL (measured by hand: > 4 min, process frozen)
    monkeypatch.setattr(scoring, "SCORE_TIMEOUT_S", 6.0)
    monkeypatch.setattr(scoring, "SCORE_RETRY_FACTOR", 1.0)  # scored again in a fresh worker, which times out too
    tower_scoring = asyncio.Event()

    async def policy(messages, *, seed, max_tokens):
        pid, turn = messages[1]["content"].split("#")[1].split()[0], len(messages) // 2 - 1
        if turn == 0:
            return {"text": action("true")}
        if pid == "tower":  # this reply ends the episode; scoring starts right after it
            asyncio.get_running_loop().call_soon(tower_scoring.set)
            return {"text": "Final answer: \\boxed{2^{2001^{2000}}}"}
        await tower_scoring.wait()  # the others answer while the tower is being scored
        return {"text": "Final answer: \\boxed{42}"}

    items = [({"id": pid, "question": f"problem #{pid} ?", "answer": "42"}, 0) for pid in ("tower", "a", "b", "c")]
    finished = []
    records = run_many(policy, items, progress=finished.append)
    tower = records[0]
    assert (tower["score"], tower["score_method"], tower["finish_reason"]) == (0.0, "answer_timeout", "final_answer")
    assert tower["seconds"] < 60  # it ended: both limits and a fresh worker's start-up, not minutes of sympy
    assert all((r["score"], r["score_method"]) == (1.0, "integer_match") for r in records[1:])
    assert [r["problem_id"] for r in finished][-1] == "tower"  # the others finished while it was being scored
    assert all(r["seconds"] < tower["seconds"] for r in records[1:])
