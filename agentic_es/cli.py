"""The stages' command line: a preset and `--key=value` overrides of common.Config (nanoGPT style), each checked
against the field's type, a stage's own options, and what `--help` prints (the comments beside Config's fields and
beside the stage's constants)."""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import sys
import textwrap
from pathlib import Path

from agentic_es.stage import ConfigError

HELP_WIDTH = 120  # --help wraps each option's meaning at this column


def parse_config(argv: list[str], base=None):
    """The run's common.Config (from `base`, else the defaults): `--preset=NAME` first, then `--key=value`
    overrides, each checked against Config's field types."""
    import common  # here: common imports torch, which a stage without run settings (00_data.py) never needs

    preset, explicit = parse_overrides(argv)
    return common.Config(**{**dataclasses.asdict(base or common.Config()), **preset, **explicit})


def parse_overrides(argv: list[str]) -> tuple[dict, dict]:
    """The values a command line sets: (the preset's, the explicit `--key=value` ones), each checked against
    Config's fields and types."""
    from common import PRESETS, Config  # here: see parse_config

    fields = {f.name: f for f in dataclasses.fields(Config)}
    defaults = dataclasses.asdict(Config())
    preset, explicit = {}, {}
    for arg in argv:
        if not arg.startswith("--") or "=" not in arg:
            raise ConfigError(f"expected --key=value, got {arg!r}")
        key, text = arg[2:].split("=", 1)
        key = key.replace("-", "_")
        if key == "preset":
            if text not in PRESETS:
                raise ConfigError(f"unknown preset {text!r}; presets: {', '.join(PRESETS)}")
            preset = dict(PRESETS[text])
        elif key in fields:
            explicit[key] = _parse_value(key, text, type(defaults[key]))
        else:
            close = difflib.get_close_matches(key, fields, n=3)
            hint = f" (did you mean {', '.join('--' + c for c in close)}?)" if close else ""
            raise ConfigError(f"unknown setting --{key}{hint}")
    return preset, explicit


def parse_args(argv: list[str], options: dict) -> tuple[dict, list[str]]:
    """Split a script's own options (`options` holds their defaults) from Config overrides (left for
    parse_config). Values are parsed to the default's type."""
    options, rest = dict(options), []
    for arg in argv:
        key = arg[2:].split("=", 1)[0].replace("-", "_") if arg.startswith("--") and "=" in arg else None
        if key in options:
            options[key] = _parse_value(key, arg.split("=", 1)[1], type(options[key]))
        else:
            rest.append(arg)
    return options, rest


def _comments_beside(source: str, pattern: str) -> dict[str, str]:
    """name -> the comment beside the line that defines it, for every line matching `pattern`, joined with the
    comment lines right under it that continue it (their `#` in the same column)."""
    found, name, column = {}, None, None
    for line in source.splitlines():
        match = re.match(pattern + r"[^#]*(?:#\s*(.*))?$", line)
        if match:
            name, column = match.group(1), line.index("#") if match.group(2) is not None else None
            found[name] = (match.group(2) or "").strip()
        elif column is not None and line.lstrip().startswith("#") and line.index("#") == column:
            found[name] += " " + line.strip()[1:].strip()
        else:
            name, column = None, None
    return found


def _described(flag: str, meaning: str) -> str:
    """One option of --help: the flag, then its meaning wrapped at HELP_WIDTH beside it."""
    return textwrap.fill(meaning, width=HELP_WIDTH, initial_indent=flag.ljust(34) + " ", subsequent_indent=" " * 35,
                         break_long_words=False, break_on_hyphens=False) if meaning else flag


def usage(doc: str, script: str | None = None, options: dict | None = None, settings: bool = True) -> str:
    """What `--help` prints: the stage's docstring, its own options (the comments beside their constants in the
    script) and every run setting with its default and the comment beside it in Config, then the presets."""
    import inspect

    parts = [doc.strip()]
    if options:
        meaning = _comments_beside(Path(script).read_text(), r"^([A-Z_]+) = ")
        parts.append("Options of this stage:\n" + "\n".join(
            _described(f"  --{k}={v}", meaning.get(k.upper(), "")) for k, v in options.items()))
    if settings:
        from common import PRESETS, Config  # here: see parse_config

        meaning = _comments_beside(inspect.getsource(Config), r"^    (\w+): [^=]+= ")
        parts.append("Run settings (common.Config; any as --key=value):\n" + "\n".join(
            _described(f"  --{k}={v}", meaning.get(k, "")) for k, v in dataclasses.asdict(Config()).items()))
        parts.append("Presets (--preset=NAME, before the other settings):\n" + "\n".join(
            f"  {name}: " + " ".join(f"--{k}={v}" for k, v in values.items()) for name, values in PRESETS.items()))
    return "\n\n".join(parts)


def exit_if_help(argv: list[str], doc: str, script: str | None = None, options: dict | None = None,
                 settings: bool = True) -> None:
    if "--help" in argv or "-h" in argv:
        try:
            print(usage(doc, script, options, settings), flush=True)
        except BrokenPipeError:  # a pipe into head: its reader has what it wanted; nothing more to print
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(0)


def _parse_value(key: str, text: str, value_type: type):
    """The value of `--key=text` as the type of the setting's default, or a ConfigError naming the type."""
    try:
        if value_type is bool:
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError
            return text.lower() in ("true", "1")
        if value_type is int:  # also "1e6"
            value = float(text) if any(c in text.lower() for c in ".e") else int(text)
            if value != int(value):
                raise ValueError
            return int(value)
        return value_type(text)
    except (ValueError, OverflowError):  # OverflowError: an integer setting given as 1e400 (float infinity)
        expected = {int: "an integer", float: "a number", bool: "true or false"}.get(value_type, value_type.__name__)
        raise ConfigError(f"--{key} expects {expected}, got {text!r}") from None
