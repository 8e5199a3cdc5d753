"""The run history (es_history.json): its file, the run settings it records, the run's identity, the refusals of
another run's history, and the rebuild of a run's weights from it.

A history opens with the run's identity (run_identity): its constants, the noise and reward definitions, the base
model's fingerprint and digests, the training data's sha256, the runtime layout, the device model and the versions;
then one record per generation, which also carries the settings a resume may change that tell how its generation ran
(generation_settings: the exact restore mode its engines used). A stage that resumes, exports or replays compares
the header with its own (check_base, check_config) and refuses a history of another run before it changes any
weight.

Export and replay take the recorded run's settings from its history (config_from_history: what defines the weights
always, never a preset's or a default) and rebuild its weights (rebuild_from_history: the refusals, then
common.replay). Replaying a history's updates is the algorithm's (common.replay), the per-rank weight digests are
digests.py's, the files and their fingerprints fileio's, an export's files export.py's, how a file older than a setting
reads it upgrade.py's. This module imports common, cli, fileio, tracking and upgrade; none of them imports it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

import torch

import common
from agentic_es import fileio, settings, stage
from agentic_es.cli import parse_overrides
from agentic_es.data import problems_sha256
from agentic_es.tracking import progress_bar
from agentic_es.upgrade import recorded_settings
from common import Config


# ---- The history file: what the stages read from it, checked before any engine starts

HISTORY_FILE = "es_history.json"
HISTORY_FORMAT = "es-history/1"
# what the stages read from a history (check_shape): a file without it is refused before any engine starts
GENERATION_RECORD_SHAPE = {"generation": int, "sigma": float, "alpha": float, "seeds": [int], "rewards": [float],
                           "z": [float], "digests": [str]}
HISTORY_SHAPE = {"config": {"population": None, "alpha": None}, "base_model": None, "base_digests": [str],
                 "generations": [GENERATION_RECORD_SHAPE]}


def read_history(path) -> dict:
    """A run history, refused with the file and the key when it lacks anything a stage reads, or when its
    generations are not generations 0, 1, 2, ... in order, each with a seed, a reward and a z-score per member."""
    history = fileio.read_json(path, required=HISTORY_SHAPE)
    for i, record in enumerate(history["generations"]):
        where = f"{path}: generations[{i}]"
        if record["generation"] != i:
            raise stage.DataError(f"{where} is generation {record['generation']}; a history holds generations 0, 1, "
                                  "2, ... in order")
        if {len(record[key]) for key in ("seeds", "rewards", "z")} != {history["config"]["population"]}:
            raise stage.DataError(f"{where} has {len(record['seeds'])} seeds, {len(record['rewards'])} rewards and "
                                  f"{len(record['z'])} z-scores; the run's population is "
                                  f"{history['config']['population']!r}: one of each per member")
    return history


# ---- The recorded run's settings: what export and replay take from a history, what a resume may change

# The settings of each role (settings.setting, beside each Config field, declares it). What defines the trained weights
# besides the history's per-generation records: export and replay take it from the history, never from the command
# line, a preset or an evaluation's settings
WEIGHT_FIELDS = settings.settings_of(common.Config, settings.WEIGHTS)
# how many engines evaluate, never what they compute: not in the history
POOL_FIELDS = settings.settings_of(common.Config, settings.POOL)
# where and how fast a run executes, never what it computes: a resume may change them (resume_free_fields), and
# 03_eval.py keeps an evaluation's finished episodes across them
EXECUTION_FIELDS = settings.settings_of(common.Config, settings.EXECUTION, settings.POOL)
# how a member's perturbation is undone: a stage that never perturbs (export, evaluation, replay) takes any value,
# e.g. an evaluation of a --restore=subtract run resumed with --restore=patch --patch_capacity=0.3
RESTORE_FIELDS = settings.settings_of(common.Config, settings.RESTORE)
# what export and replay take from their command line (their --help lists them; with checkpoint noise the TP size
# too: resume_free_fields): every other setting is the recorded run's
REBUILD_FIELDS = EXECUTION_FIELDS + RESTORE_FIELDS


def history_fitness(history: dict) -> str | None:
    """The fitness a history's run trained on (Config.fitness): the one it records. A history written before the
    setting (7feb967) records none, and the code of that time had two: 01_train.py's agent score, and the shaped
    reward bench/learning.py passed in, on the learn task only. Its rewards tell them apart: the agent's score is 0
    or 1 an episode, so each member's fitness is a whole number of episodes over case_batch, where the shaped
    reward's partial credit (0.1, 0.25, 0.5) gives other means in every measured run's first generation. None where
    they cannot tell: a learn-task history whose every reward is 0 (both give that)."""
    config = history["config"]
    if "fitness" in config:
        return config["fitness"]
    if config.get("train_data") != "learn":
        return "agent"
    episodes = config["case_batch"]
    rewards = [r for record in history.get("generations", []) for r in record["rewards"]]
    if any(abs(r * episodes - round(r * episodes)) > 1e-9 for r in rewards):
        return "shaped"
    return "agent" if any(rewards) else None


def history_settings(history: dict) -> dict:
    """What a history records of its run's settings (upgrade.recorded_settings), the fitness of a history older than
    the setting as its rewards tell (history_fitness; where they cannot, what the code did before it)."""
    config = without_retired_settings(history["config"])
    fitness = history_fitness(history)
    return recorded_settings({**config, **({"fitness": fitness} if fitness else {})})


def config_as_trained(history: dict) -> dict:
    """A history's config with the fitness its run trained on where it predates the setting and its rewards tell:
    what an export's manifest records of the run."""
    fitness = history_fitness(history)
    return {**history["config"], **({"fitness": fitness} if fitness else {})}


def older_fitness_differences(history: dict, fitness: str) -> list[str]:
    """A resume under `fitness` of a history older than the setting: refused where its rewards read otherwise
    (history_fitness) or cannot tell."""
    then = history_fitness(history)
    if then is None:
        return [f"config fitness: the history predates the setting, and its rewards (every one 0) cannot tell the "
                f"agent's score from the shaped reward; this run has {fitness!r}: add \"fitness\" (\"agent\" or "
                "\"shaped\", as its run trained) to the history's config"]
    if then == fitness:
        return []
    if history["config"].get("train_data") != "learn":  # the shaped reward was the learn task's
        why = "what the code did before it"
    elif then == "shaped":
        why = ("read from its rewards, not each a whole number of episodes over case_batch, which the agent's score "
               "gives")
    else:
        why = "read from its rewards, each a whole number of episodes over case_batch, as the agent's score gives"
    return [f"config fitness: history has {then!r} (the history predates the setting: {why}), this run has "
            f"{fitness!r}"]


def resume_free_fields(config: dict) -> tuple[str, ...]:
    """EXECUTION_FIELDS; after an exact restore mode the restore mode and the patch's capacity (every exact mode
    leaves the same bits: a patch overflow's advice, another capacity or copy_device, resumes the run; a move to the
    inexact subtract is refused by identity_differences); with checkpoint noise the TP size: its weights are the
    same at every TP size. `config`: a history's."""
    config = recorded_settings(config)
    exact = config["restore"] != "subtract"
    return (EXECUTION_FIELDS + (RESTORE_FIELDS if exact else ())
            + (("tensor_parallel_size",) if common.is_checkpoint_noise(config) else ()))


# settings a resume may change (resume_free_fields) that each generation's record carries, so that the history tells
# how every generation ran: the header's config keeps the first run's values. A record written before records carried
# them (an older history) ran with the header's, unless a resume changed them and left no trace; one written before
# the engines reported their restore mode carries the run's --restore (a "copy_device" may have run as copy_host).
GENERATION_SETTINGS = RESTORE_FIELDS


def generation_settings(cfg: Config, restore_modes: list[str]) -> dict:
    """What a generation record carries of the settings it ran with (GENERATION_SETTINGS): the restore mode its
    engines used (restore_modes, one per engine: a memory plan may have put a copy_device copy in host memory,
    copy_host), one mode where they agree, else the list of them in engine order; the patch's capacity."""
    modes = list(dict.fromkeys(restore_modes))
    return {"restore": modes[0] if len(modes) == 1 else list(restore_modes), "patch_capacity": cfg.patch_capacity}


def without_retired_settings(config: dict) -> dict:
    """A recorded config without `scope` and its `lora_rank`, which a history may record and this code does not
    have: scope="full" (every member perturbs every parameter) is what this code does; any other scope is refused
    (bench/README.md, "Low-rank members", says why there is no other)."""
    if config.get("scope", "full") != "full":
        raise stage.ConfigError(f"the run was trained with scope={config['scope']!r}, which this version of the code "
                                "no longer has (bench/README.md, \"Low-rank members\"): use the version that trained it")
    return {k: v for k, v in config.items() if k not in ("scope", "lora_rank")}


def config_from_history(history: dict, argv: list[str], settings: dict | None = None) -> Config:
    """The constants of a recorded run, for a stage that rebuilds its weights (export, replay). WEIGHT_FIELDS come
    from the history; every other field from `settings` (e.g. an evaluation's sampling and agent settings), else
    from the history; a field a file lacks as the code ran before the field existed (upgrade.recorded_settings).
    `--preset` fills in only the settings that may differ between runs (REBUILD_FIELDS: EXECUTION_FIELDS, such as
    run_dir, and RESTORE_FIELDS: these stages never perturb), never a recorded value; an explicit `--key=value` that
    differs from a recorded one is refused."""
    recorded_run = history_settings(history)  # (without_retired_settings refuses a run this code cannot rebuild)
    given = recorded_settings(without_retired_settings(settings)) if settings else recorded_run
    run_settings = {k: v for k, v in given.items()
                    if k not in POOL_FIELDS}  # where engines run is this machine's, from the command line
    free_fields = resume_free_fields(history["config"]) + REBUILD_FIELDS
    values = {**run_settings, **{f: recorded_run[f] for f in WEIGHT_FIELDS if f not in free_fields}}
    unknown = sorted(set(values) - {f.name for f in dataclasses.fields(Config)})
    if unknown:
        raise stage.ConfigError(f"the recorded settings {', '.join(unknown)} are unknown to this version of the code")
    recorded = Config(**values)
    preset, explicit = parse_overrides(argv)
    refused = [f"--{k}={v!r} (recorded: {getattr(recorded, k)!r}{', from the history' if k in WEIGHT_FIELDS else ''})"
               for k, v in explicit.items() if k not in free_fields and v != getattr(recorded, k)]
    if refused:
        raise stage.ConfigError("these settings were recorded by the run and cannot be overridden: "
                                + ", ".join(refused))
    free = {k: v for k, v in {**preset, **explicit}.items() if k in free_fields}
    return dataclasses.replace(recorded, **free)


# ---- A run's identity, and the refusals of a history made by another run

def run_identity(cfg: common.Config, model_path: str, engine, train_data: bool = True) -> dict:
    """The header of a history: what must be equal for a replay to reproduce the trained weights bit for bit, read
    from `engine` (an engine.Engine or a pool.EnginePool holding the base weights). Without train_data the training
    data file is not read (export and replay rebuild theta without it)."""
    import vllm

    data = {}
    if train_data:  # export and replay rebuild theta without the training data file
        data["train_data_sha256"] = train_data_sha256(cfg)
    return {
        "format": HISTORY_FORMAT,
        "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k not in POOL_FIELDS},  # any K, one history
        "noise": common.noise_definition(cfg),
        "reward": common.reward_definition(cfg.fitness),  # how its rewards are scored: a resume under others refused
        **data,
        "base_model": cfg.model,
        "base_model_path": str(model_path),
        "base_fingerprint": fileio.model_fingerprint(model_path),
        "base_digests": engine.base_digests(model_path),
        "parameter_names_sha256": engine.parameter_names_sha256(),
        "tensor_parallel_size": cfg.tensor_parallel_size,
        "dtype": cfg.dtype,
        "device_type": engine.device,
        "devices": engine.rpc(common.ESWorker.es_device),  # per rank: the noise streams depend on the device model
        "vllm_version": vllm.__version__,
        "torch_version": torch.__version__,
    }


def train_data_sha256(cfg: common.Config) -> str:
    """The training problems' fingerprint (data.problems_sha256), so that a history of another version of them is
    refused."""
    return problems_sha256(cfg.train_data, cfg.run_seed, cfg.learn_digits, cfg.compute_level)


def field_differences(first: dict, second: dict, first_name: str, second_name: str, prefix: str = "") -> list[str]:
    """Each field (nested ones dotted: config.temperature) whose value differs between two records, with both
    values: "config.temperature: 0.6 in eval_run.json, 0.7 in this evaluation". A long value is cut short."""
    def shown(value) -> str:
        text = repr(value)
        return text if len(text) <= 160 else text[:150] + " ...]"

    diffs = []
    for key in sorted(set(first) | set(second), key=str):
        a, b, name = first.get(key, "(absent)"), second.get(key, "(absent)"), f"{prefix}{key}"
        if isinstance(a, dict) and isinstance(b, dict):
            diffs += field_differences(a, b, first_name, second_name, f"{name}.")
        elif a != b:
            diffs.append(f"{name}: {shown(a)} in {first_name}, {shown(b)} in {second_name}")
    return diffs


def identity_differences(recorded: dict, current: dict, compare_config: bool = True) -> list[str]:
    """Human-readable differences between a history's identity and this run's (empty: compatible). Without
    compare_config only what defines the weights is compared (base, noise, layout, TP, device, versions)."""
    diffs, any_tp = [], common.is_checkpoint_noise(recorded.get("config", {}))
    for key, value in current.items():
        if not compare_config and key in ("config", "train_data_sha256", "reward"):
            continue
        if any_tp and key in ("tensor_parallel_size", "parameter_names_sha256"):
            continue  # checkpoint noise: the same weights at every TP size (the digests compare them)
        if key == "config":
            then_config = history_settings(recorded)  # a field newer than the history: the code before it
            for field, now in value.items():
                then = then_config.get(field)
                if field == "fitness" and field not in recorded["config"]:
                    diffs += older_fitness_differences(recorded, now)
                elif field not in resume_free_fields(recorded["config"]) and then != now:
                    older = ("" if field in recorded["config"]
                             else " (the history predates the setting: what the code did before it)")
                    diffs.append(f"config {field}: history has {then!r}{older}, this run has {now!r}")
                elif field == "restore" and now == "subtract" != then:
                    diffs.append(f"config restore: history has {then!r} (exact), this run has 'subtract' (not exact)")
        elif key == "reward":
            diffs += history_reward_differences(recorded, value)
        elif key == "devices" and any_tp:
            diffs += device_differences(recorded.get(key) and recorded[key][:1], value[:1])
        elif key == "devices":
            diffs += device_differences(recorded.get(key), value)
        elif key == "base_fingerprint" and recorded.get(key) == name_only_fingerprint(recorded.get("base_model")):
            continue  # an older history of a hub id recorded only its name; base_digests still compare the bits
        elif key not in ("base_model_path",) and recorded.get(key) != value:
            diffs.append(f"{key}: history has {recorded.get(key)!r}, this run has {value!r}")
    return diffs


def history_reward_differences(history: dict, current: dict) -> list[str]:
    """What differs between the reward definition a history's run trained under and this run's
    (common.reward_definition; the fitness mode is compared as a setting). A history written before definitions
    were recorded: on the shaped reward refused, as its rules changed at 097270a (`seq 0 40` earned 0.5 before, 0.25
    since) and which ones trained it the file cannot tell; on the agent's score resumed, as every resume of one was
    before (its scorer's version is not recorded either)."""
    recorded = history.get("reward")
    if recorded is None:
        if history_fitness(history) != "shaped":
            return []
        return [f"reward: the history records no reward definition (written before they were recorded), and the "
                f"shaped reward's rules changed at 097270a (`seq 0 40` earned 0.5, since 0.25), so which ones trained "
                f"it the file cannot tell; this run has {current!r}. Resume it with the code that trained it, or, "
                f"where it trained under these rules (a commit since 097270a), add \"reward\": {json.dumps(current)} "
                "to its header"]
    return common.reward_differences(recorded, {k: v for k, v in current.items() if k != "fitness"}, "history",
                                     "this run")


def name_only_fingerprint(model: str | None) -> str:
    """What older histories recorded for a hub id: a hash of its name, not of its weights."""
    return "name-only:" + hashlib.sha256(str(model).encode()).hexdigest()


def describe_devices(devices: list[dict]) -> str:
    """Per-rank devices in words: '2 x NVIDIA H200 (132 SMs)'."""
    names = [d["name"] + (f" ({d['sm_count']} SMs)" if d.get("sm_count") else "") for d in devices]
    return ", ".join(f"{names.count(n)} x {n}" for n in dict.fromkeys(names))


# Device models measured to draw the same noise and apply the same updates bit for bit: every generation's digests of
# a history made on one equal when replayed on the other (bench/noise_across_devices.py --record writes each
# measurement here, with what it replayed). A history of one resumes, exports and replays on the others of its group.
SAME_NOISE_FILE = Path(__file__).with_name("same_noise.json")


def same_noise_groups() -> list[set[tuple[str, int]]]:
    """The groups of SAME_NOISE_FILE, each a set of (name, SM count); none where no pair has been measured."""
    if not SAME_NOISE_FILE.exists():
        return []
    entries = json.loads(SAME_NOISE_FILE.read_text())
    return [{(name, sm_count) for name, sm_count in entry["models"]} for entry in entries]


def noise_model(device: dict, groups: list[set]) -> tuple:
    """The device as far as the noise is concerned: its group of `groups` where it has one, else itself."""
    key = (device.get("name"), device.get("sm_count"))
    return next((tuple(sorted(group)) for group in groups if key in group), key)


def device_differences(recorded: list[dict] | None, current: list[dict]) -> list[str]:
    """CUDA's random streams depend on the GPU model (and torch's CPU normals on its kernel set), so the recorded
    noise exists only on the device model the run was trained on, or one measured to draw the same (SAME_NOISE_FILE)."""
    if recorded is None:
        return [f"devices: the history does not record the device model it was made on (an older history), and "
                f"the noise streams depend on it; this run is on {describe_devices(current)}. If the history was "
                f"made on that model, add \"devices\": {json.dumps(current)} to its header"]
    groups = same_noise_groups()
    if [noise_model(d, groups) for d in recorded] != [noise_model(d, groups) for d in current]:
        return [f"devices: the history was made on {describe_devices(recorded)}, this run is on "
                f"{describe_devices(current)}; the noise streams depend on the device model, so resume, export and "
                f"replay only on {describe_devices(recorded)}, or on a model that bench/noise_across_devices.py "
                f"--record measures to draw the same noise"]
    return []


def check_base(recorded: dict, current: dict, compare_config: bool = True) -> None:
    """Refuse a history whose base, noise or runtime layout (or, by default, run constants) differ from this
    engine's."""
    diffs = identity_differences(recorded, current, compare_config)
    if diffs:
        raise stage.HistoryMismatch("this history was made by a different run:\n  " + "\n  ".join(diffs))


def check_base_files(recorded: dict, model_path: str) -> None:
    """Refuse a history of another base by its weight files' fingerprint, before an engine starts (rebuilding
    compares the base's digests too, once an engine holds the weights: they alone judge a history without one)."""
    if "base_fingerprint" in recorded:
        check_base(recorded, {"base_fingerprint": fileio.model_fingerprint(model_path)}, compare_config=False)


def check_config(recorded: dict, cfg: common.Config) -> None:
    """Refuse a history (`recorded`) of other run constants or another reward definition than cfg's, before any
    engine starts."""
    check_base(recorded, {"config": dataclasses.asdict(cfg), "reward": common.reward_definition(cfg.fitness)})


def rebuild_from_history(engine, cfg: Config, model_path: str, history: dict, generations: list[dict],
                         compare_config: bool = True, desc: str = "replaying history") -> tuple[dict, list[str]]:
    """Refuse a history of another base (and, by default, other run constants), then replay `generations` on the
    engine's base weights. Returns this engine's identity and the rebuilt per-rank digests."""
    identity = run_identity(cfg, model_path, engine, train_data=compare_config)
    check_base(history, identity, compare_config)
    return identity, common.replay(engine, progress_bar(generations, desc=desc, leave=False), identity["base_digests"])
