"""A model's reply and the command's result: the bash action the reply asks for (parse_action), the first well-formed
{"name": "bash", "arguments": {"command": ...}} object, with a relaxed reading of the common slip of unescaped
quotes (think blocks and the committed answer are scoring.py's); and the command's result as the next user message
(format_observation). A leaf: the agent loop (common.py) and the rewards
that read an episode's commands (learn_task.py) import it.
"""

from __future__ import annotations

import json
import re

from agentic_es import scoring

_JSON = json.JSONDecoder(strict=False)  # strict=False: models often put raw newlines inside the command string
_OBJECT_START = re.compile(r'\{\s*"')   # decode only where an object with a key may start (LaTeX is full of '{')
_RELAXED_ACTION = re.compile(r'"name"\s*:\s*"bash".*?"command"\s*:\s*"(.*?)"\s*\}\s*\}', re.DOTALL)
_ESCAPE_OR_QUOTE = re.compile(r'\\(?:u[0-9a-fA-F]{4}|["\\/bfnrt])|\\|"')  # a JSON escape, a bare backslash or quote


def _bash_command(obj):
    """The command of a decoded {"name": "bash", "arguments": {"command": ...}} object, else None."""
    if not isinstance(obj, dict) or obj.get("name") != "bash":
        return None
    arguments = obj.get("arguments")
    if isinstance(arguments, str):  # OpenAI style: arguments is itself a JSON string
        try:
            arguments = json.loads(arguments, strict=False)
        except ValueError:
            return None
    if isinstance(arguments, dict) and isinstance(arguments.get("command"), str):
        return arguments["command"]
    return None


def parse_action(text):
    """The bash command of the FIRST well-formed bash action in the reply (prose and code fences around it are
    fine), or None, also when that command is blank. First, because the model is told to act once per reply and
    anything written after its first call was written without seeing that call's output. If no object decodes, a
    relaxed pattern catches the common slip of unescaped double quotes inside the command string; its text is
    decoded as a JSON string's (json_string_text)."""
    text = scoring.strip_think(text)
    for start in _OBJECT_START.finditer(text):
        try:
            obj, _ = _JSON.raw_decode(text, start.start())
        except ValueError:
            continue
        command = _bash_command(obj)
        if command is not None:  # a blank command runs nothing: no call (it never counts as the required one)
            return command if command.strip() else None
    relaxed = _RELAXED_ACTION.search(text)
    command = json_string_text(relaxed.group(1)) if relaxed else None
    return command if command and command.strip() else None


def json_string_text(raw: str) -> str:
    r"""The text of a JSON string's body whose double quotes may be unescaped: its escapes (\n, \t, \", \\,
    \uXXXX, ...) decoded as json decodes them. When a backslash starts no JSON escape (grep '\d', a trailing
    backslash) or a \u escape leaves half a surrogate pair, the model did not write JSON escapes: the text is taken
    verbatim, its backslashes the shell's."""
    def quoted(match):
        token = match.group(0)
        if token == "\\":
            raise ValueError("not a JSON escape")
        return '\\"' if token == '"' else token

    try:
        text = json.loads('"' + _ESCAPE_OR_QUOTE.sub(quoted, raw) + '"', strict=False)
        text.encode("utf-8")  # a lone surrogate is no text the shell can be given
    except ValueError:  # (UnicodeEncodeError is one)
        return raw
    return text


# ---- Observations: a command's result as the next user message

def _head_tail(text, limit_chars):
    if len(text) <= limit_chars:
        return text
    cut = len(text) - limit_chars
    half = limit_chars // 2
    return f"{text[:half]}\n[... {cut} characters cut ...]\n{text[len(text) - (limit_chars - half):]}"


def format_observation(result, limit_chars):
    """The user message that reports a command's result to the model, cut to about limit_chars (head + tail)."""
    lines = []
    if result["timed_out"]:
        lines.append(f"The command timed out after {result['timeout_s']} s and was killed.")
    lines.append(f"exit code: {result['exit_code']}")
    for stream in ("stdout", "stderr"):
        lines.append(f"{stream}:\n" + (result[stream].rstrip("\n") or "(empty)"))
    return _head_tail("\n".join(lines), limit_chars)
