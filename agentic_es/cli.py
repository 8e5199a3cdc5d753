"""The stages' command line: a preset and `--key=value` overrides of common.Config (nanoGPT style), each checked
against the field's type, a stage's own options, and what `--help` prints (each setting as Config declares it,
grouped by its role with that role's rules, and the comments beside the stage's constants)."""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import sys
import textwrap
from pathlib import Path

from agentic_es import stage
from agentic_es.settings import PRESETS


HELP_WIDTH = 120  # --help wraps each option's meaning at this column
# What --help says of the settings of each role (settings.setting declares a setting's role: settings.WEIGHTS,
# RUN, RESTORE, EXECUTION, POOL), in this order
ROLE_RULES = {
    "weights": "What defines the trained weights: a resume keeps them, export and replay take them from the history "
               "(with --noise=checkpoint the TP size is free: its weights are the same at every TP size)",
    "run": "The run's constants: a resume keeps them (a history of other constants is refused, naming them), an "
           "evaluation reuses its finished episodes only under the same, export takes them from the history and the "
           "replay from the evaluation it replays",
    "restore": "How a member's perturbation is undone: a resume after an exact mode may move to another exact one "
               "(never to subtract); export, evaluation and replay never perturb and take any",
    "execution": "Where and how fast a stage runs, never what it computes: a resume may change them, an evaluation "
                 "keeps its finished episodes across them, export and replay take them from their command line",
    "pool": "How many engines run, and where: this machine's, from the command line, never recorded in a history",
}
# The title of the settings in --help of a stage that rebuilds a recorded run (export, replay: history.REBUILD_FIELDS)
REBUILD_TITLE = ("Run settings this stage takes (common.Config; as --key=value). Every other setting is the recorded "
                 "run's (what defines the weights the history's; the others the history's for an export, the "
                 "evaluation's for a replay): a --key=value that differs from a recorded value is refused. With a "
                 "history of --noise=checkpoint --tensor_parallel_size is free too. --preset=NAME supplies only these.")


def parse_config(argv: list[str], base=None):
    """The run's common.Config (from `base`, else the defaults): `--preset=NAME` first, then `--key=value`
    overrides, each checked against Config's field types."""
    import common  # here: common imports torch, which a stage without run settings (00_data.py) never needs

    preset, explicit = parse_overrides(argv)
    return common.Config(**{**dataclasses.asdict(base or common.Config()), **preset, **explicit})


def parse_overrides(argv: list[str]) -> tuple[dict, dict]:
    """The values a command line sets: (the preset's, the explicit `--key=value` ones), each checked against
    Config's fields and types."""
    from common import Config  # here: see parse_config

    fields = {f.name: f for f in dataclasses.fields(Config)}
    defaults = dataclasses.asdict(Config())
    preset, explicit = {}, {}
    for arg in argv:
        if not arg.startswith("--") or "=" not in arg:
            raise stage.ConfigError(f"expected --key=value, got {arg!r}")
        key, text = arg[2:].split("=", 1)
        key = key.replace("-", "_")
        if key == "preset":
            if text not in PRESETS:
                raise stage.ConfigError(f"unknown preset {text!r}; presets: {', '.join(PRESETS)}")
            preset = dict(PRESETS[text])
        elif key in fields:
            explicit[key] = _parse_value(key, text, type(defaults[key]))
        else:
            close = difflib.get_close_matches(key, fields, n=3)
            hint = f" (did you mean {', '.join('--' + c for c in close)}?)" if close else ""
            raise stage.ConfigError(f"unknown setting --{key}{hint}")
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


def usage(doc: str, script: str | None = None, options: dict | None = None, settings: bool | tuple = True) -> str:
    """What `--help` prints: the stage's docstring, its own options (the comments beside their constants in the
    script), the run settings with their defaults and meanings, grouped by role under its rules (every setting, or
    a tuple of them: only those, for a stage that takes the rest from a recorded run), then the presets (of a tuple,
    only its settings)."""
    parts = [doc.strip()]
    if options:
        meaning = _comments_beside(Path(script).read_text(), r"^([A-Z_]+) = ")
        parts.append("Options of this stage:\n" + "\n".join(
            _described(f"  --{k}={v}", meaning.get(k.upper(), "")) for k, v in options.items()))
    if settings:
        from common import Config  # here: see parse_config

        shown = [f for f in dataclasses.fields(Config) if settings is True or f.name in settings]
        groups = ["\n".join([textwrap.fill(rules + ":", width=HELP_WIDTH, break_on_hyphens=False)] + [
            _described(f"  --{f.name}={f.default}", f.metadata["help"]) for f in shown if f.metadata["role"] == role])
            for role, rules in ROLE_RULES.items() if any(f.metadata["role"] == role for f in shown)]
        title = ("Run settings (common.Config; any as --key=value, each checked against its range or choices)"
                 if settings is True else REBUILD_TITLE)
        parts.append("\n\n".join([textwrap.fill(title, width=HELP_WIDTH, break_on_hyphens=False), *groups]))
        names = {f.name for f in shown}
        parts.append("Presets (--preset=NAME, before the other settings):\n" + "\n".join(
            f"  {name}: " + " ".join(f"--{k}={v}" for k, v in values.items() if k in names)
            for name, values in PRESETS.items()))
    return "\n\n".join(parts)


def exit_if_help(argv: list[str], doc: str, script: str | None = None, options: dict | None = None,
                 settings: bool | tuple = True) -> None:
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
        raise stage.ConfigError(f"--{key} expects {expected}, got {text!r}") from None
