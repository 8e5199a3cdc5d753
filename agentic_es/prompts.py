"""Each agent turn's prompt as token ids (Config.prompt_mode): the chat template's rendering of the conversation,
or the previous turn's ids continued (ChatPrompts); which mode a model's template allows (choose_prompt_mode). A
leaf: the agent loop (common.py) and the engine import it.
"""

from __future__ import annotations

import functools
import warnings

# What the model sees on each agent turn (Config.prompt_mode):
# "render" (default): the chat template renders the whole conversation every turn, Qwen3 thinking off. That is
#   vLLM's standard chat rendering (how the reference ran its ReAct loop, and how the trained model is served), so
#   rewards are earned on the prompts the model is evaluated and used with. Qwen3's template is not append-only: an
#   assistant turn followed by a user message loses the empty think block its generation prompt opened (and any
#   reasoning), and its text is re-tokenized. The prefix cache then covers the history up to the last assistant
#   turn's generation prompt; that turn's reply is prefilled again.
# "continue": the previous prompt + the generated ids (+ the end token if the reply was cut off) + the template's
#   rendering of the new user message and generation prompt. The model sees exactly the tokens it produced and the
#   prefix cache covers everything, but with Qwen3's template every earlier assistant turn keeps its
#   `<think>\n\n</think>\n\n` (and any reasoning), which re-rendering drops. Needs a template that renders a user
#   turn after an assistant turn the same whatever came before; otherwise the engine warns at start-up and renders,
#   and every record says prompt_mode="render".

def continuation_user_turn(tokenizer) -> tuple[str, str] | None:
    """The chat template's text for a user message after an assistant message, from the assistant's end token
    through the next generation prompt: (before, after) the message. None if the template does not close an
    assistant message with the end token, or renders the user turn differently after different histories."""
    mark, eos = "\x00USER\x00", tokenizer.eos_token
    render = functools.partial(tokenizer.apply_chat_template, tokenize=False, add_generation_prompt=True,
                               enable_thinking=False)
    turns = set()
    for reply in ("a", "<think>\nr\n</think>\n\nb"):  # the user turn must not depend on the history
        text = render([{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                       {"role": "assistant", "content": reply}, {"role": "user", "content": mark}])
        if text.count(mark) != 1 or eos not in text[:text.index(mark)]:
            return None
        end = text.rindex(eos, 0, text.index(mark))
        if not text[:end].endswith(reply[-1]):  # the end token must follow the reply's text directly
            return None
        turns.add(text[end + len(eos):])
    if len(turns) != 1:
        return None
    before, after = turns.pop().split(mark)
    return before, after


def choose_prompt_mode(requested: str, tokenizer, name: str = "the model") -> str:
    """The prompt mode the engine will use: the requested one, or "render" (with a warning) if it cannot continue."""
    if requested == "continue" and continuation_user_turn(tokenizer) is None:
        warnings.warn(f"prompt_mode='continue' is impossible with the chat template of {name} (it does not render "
                      "a user turn the same after every assistant turn): every turn renders the whole conversation",
                      stacklevel=2)
        return "render"
    return requested


class ChatPrompts:
    """Each agent turn's prompt token ids in `mode` (the requested prompt mode, or "render" where the chat template
    cannot continue): the template's rendering of the conversation, Qwen3 thinking off; or in "continue" the
    previous turn's prompt and generated ids + the template's rendering of the new user turn. The policy asks ids()
    for a turn's prompt and tells remember() what the turn generated; conversations are told apart by their message
    list (one per episode, see run_episode)."""

    def __init__(self, tokenizer, requested: str, name: str = "the model"):
        self.tokenizer = tokenizer
        self.mode = choose_prompt_mode(requested, tokenizer, name)
        self.turns = {}  # id(messages) -> the last turn's messages and token ids (see remember)

    def ids(self, messages: list[dict]) -> list[int]:
        """This turn's prompt ids: a continued conversation must be the one remember() kept plus one user message;
        the first turn is always rendered."""
        last = self.turns.pop(id(messages), None)
        if (self.mode == "continue" and last is not None and messages[-1]["role"] == "user"
                and messages[:-1] == last["messages"]):
            before, after = self.user_turn
            return last["ids"] + self.tokenizer.encode(before + messages[-1]["content"] + after,
                                                       add_special_tokens=False)
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False,
                                                  tokenize=True, return_dict=False)

    def remember(self, messages: list[dict], ids: list[int], completion) -> None:
        """A turn's prompt ids and its completion (token_ids, text), for the next turn to continue."""
        if self.mode != "continue":
            return
        generated = list(completion.token_ids)
        eos = self.tokenizer.eos_token_id
        if not generated or generated[-1] != eos:  # cut off by the token budget: close the message as the template does
            generated.append(eos)
        self.turns[id(messages)] = {"messages": [*messages, {"role": "assistant", "content": completion.text}],
                                    "ids": ids + generated}

    def forget(self) -> None:
        """Drop the remembered turns (a batch of episodes ended)."""
        self.turns.clear()

    @functools.cached_property
    def user_turn(self) -> tuple[str, str] | None:
        return continuation_user_turn(self.tokenizer)
