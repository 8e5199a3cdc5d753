"""Files written by older code, read as that code read them (upgrade on read): a table per kind of record of what
an older one lacks, because the code that wrote it had no such field, and how the code of its time did without it.
SETTINGS_ADDED: a run's recorded settings (a history's config, an evaluation's marker or eval16 file);
EVALUATION_KEYS_ADDED: an evaluation's marker and eval16 files; GENERATION_KEYS_ADDED and EPISODE_KEYS_ADDED: a
history's generation records and an evaluation's episode records. Every reader of such a file passes it through here
and then reads today's fields plainly: the past lives in these tables, and no setting of common.Config carries its
own. (A history's fitness before the setting is read from its rewards: history.history_fitness.)
"""

from __future__ import annotations

import dataclasses


def prompt_mode_then(recorded: dict) -> str:
    """How a file written before prompt_mode built each turn's prompt: from 3c340be, which also added
    cudagraph_mode, the generated ids were continued; before it (71e1e68..3c340be) the conversation was rendered
    every turn."""
    return "continue" if "cudagraph_mode" in recorded else "render"


# The Config settings newer than the first files (71e1e68 wrote them): the commit that added each, and what the code
# did before it (a value, or a function of the file's recorded settings where that changed before the setting
# existed: they tell when the file was written). A file lacking one reads as its own code ran, whatever the default is
# now; a setting as old as the files that one lacks reads as its default.
SETTINGS_ADDED = {
    "cudagraph_mode": ("3c340be", "FULL_DECODE_ONLY"),  # the engine's fixed mode
    "max_num_batched_tokens": ("0d8f68d", 0),  # vLLM's default
    "custom_all_reduce": ("9fe2601", False),  # always off
    "engines": ("a55413f", 1),  # one engine
    "ray_address": ("a55413f", ""),  # in this process
    "fitness": ("7feb967", "agent"),  # 01_train.py's mean agent score (history.history_fitness reads a history's)
    "patch_capacity": ("6f9fabc", 0.0),  # no patch
    "rounding": ("c98db3b", "nearest"),
    "noise": ("20ebd4c", "rank_salted"),  # the only noise
    "allow_leaky_sandbox": ("174fe5b", True),  # no leak check
    "prompt_mode": ("6bbc789", prompt_mode_then),
    "learn_digits": ("6bc9b3c", 0),  # the numbers 2..19
    "compute_level": ("fc41032", 1),  # no compute task: such a run reads as level 1
    "smoke_eval": ("ab29bcf", False),  # the DAPO and AIME files
    "tracking": ("bbb9ffd", "none"),
    "speculative": ("6d62433", "off"),  # no drafts (the three below: their defaults, unused while off)
    "speculative_tokens": ("6d62433", 4),
    "ngram_lookup_max": ("6d62433", 4),
    "ngram_lookup_min": ("6d62433", 2),
}

# What an evaluation's files (its marker eval_run.json and its <set>_eval16.json files) recorded only from a later
# commit on: None in an older file, which its readers then take as the code of its time did (the data by its path
# only, and no reward definition to compare).
EVALUATION_KEYS_ADDED = {"data_sha256": None, "reward": None}
# What a history's generation record and an evaluation's episode record counted only from a later commit on: an older
# record counted no replies cut at the token limit (None: not shown), no scorer failures, no breakdown of its time
# (None: not shown), no finish reasons (None: its episodes count as unrecorded, metrics.cut_replies).
GENERATION_KEYS_ADDED = {"replies": None, "scorer_failures": {}, "time_breakdown": None}
EPISODE_KEYS_ADDED = {"reply_finish_reasons": None}


def settings_then(field: dataclasses.Field, recorded: dict):
    """What a file lacking this Config field read it as (SETTINGS_ADDED; the default for a field as old as the
    files)."""
    if field.name not in SETTINGS_ADDED:
        return field.default
    then = SETTINGS_ADDED[field.name][1]
    return then(recorded) if callable(then) else then


def recorded_settings(config: dict) -> dict:
    """What a file records of a run's settings (a history's or an evaluation's config), each Config field it lacks
    as the code that wrote it ran (settings_then)."""
    import common

    return {**config, **{f.name: settings_then(f, config) for f in dataclasses.fields(common.Config)
                         if f.name not in config}}


def upgraded(record: dict, added: dict) -> dict:
    """A file or record with each key of `added` (EVALUATION_KEYS_ADDED, GENERATION_KEYS_ADDED, EPISODE_KEYS_ADDED)
    that it lacks, as that table reads it."""
    return {**added, **record}
