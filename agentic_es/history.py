"""The run history and the manifests: what identifies a run, and the refusals of another run's files.

A history (es_history.json) opens with the run's identity (run_identity): its constants, the noise definition, the
base model's fingerprint and digests, the training data's sha256, the runtime layout, the device model and the
versions; then one record per generation, which also carries the settings a resume may change that tell how its
generation ran (generation_settings: the exact restore mode). A stage that resumes, exports or replays compares the
header with its own (check_base, check_config) and refuses a history of another run before it changes any weight.
Published files carry fingerprints: SHA256SUMS beside them (`sha256sum -c SHA256SUMS` checks them), and a
sharded_state export its manifest (each shard's sha256, the per-rank digests of the weights), checked before
anything loads it (verify_export, check_loaded_export).

Export and replay take the recorded run's settings from its history (config_from_history: what defines the weights
always, never a preset's or a default) and rebuild its weights (rebuild_from_history: the refusals, then
common.replay). The algorithm stays in common: replaying a history's updates, the per-rank weight digests the TP
workers compute, and the atomic JSON and JSONL files. This module imports common, cli and tracking; none of them
imports it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import torch

import common
from agentic_es import fileio
from agentic_es.cli import parse_overrides
from agentic_es.data import GENERATED_DATA, problems_from
from agentic_es.tracking import progress_bar
from common import Config, ConfigError, ExportError


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
            raise common.DataError(f"{where} is generation {record['generation']}; a history holds generations 0, 1, "
                                   "2, ... in order")
        if {len(record[key]) for key in ("seeds", "rewards", "z")} != {history["config"]["population"]}:
            raise common.DataError(f"{where} has {len(record['seeds'])} seeds, {len(record['rewards'])} rewards and "
                                   f"{len(record['z'])} z-scores; the run's population is "
                                   f"{history['config']['population']!r}: one of each per member")
    return history


# ---- The recorded run's settings: what export and replay take from a history, what a resume may change

# What defines the trained weights besides the history's per-generation records (seeds, z, alpha): the base model,
# the runtime layout (TP size, dtype) and the noise. Export and replay take them from the history, never from the
# command line, a preset or an evaluation's settings.
WEIGHT_FIELDS = ("model", "tensor_parallel_size", "dtype", "noise_chunk", "rounding", "noise")
POOL_FIELDS = ("engines", "ray_address")  # how many engines evaluate, never what they compute: not in the history
# settings that may change between a run and its resume: where files go, and how fast and how many episodes the
# engine steps at once. They never touch the weights (and a GPU's sampling is not batch-invariant anyway)
RESUME_FREE_FIELDS = ("run_dir", "concurrency", "gpu_memory_utilization", "smoke_eval", "tracking", *POOL_FIELDS,
                      "cuda_graphs", "cudagraph_mode", "max_num_batched_tokens", "custom_all_reduce")
# how a member's perturbation is undone: a stage that never perturbs (export, evaluation, replay) takes any value,
# e.g. an evaluation of a --restore=subtract run resumed with --restore=patch --patch_capacity=0.3
RESTORE_FIELDS = ("restore", "patch_capacity")


def resume_free_fields(config: dict) -> tuple[str, ...]:
    """RESUME_FREE_FIELDS; after an exact restore mode the restore mode and the patch's capacity (every exact mode
    leaves the same bits: a patch overflow's advice, another capacity or copy_device, resumes the run; a move to the
    inexact subtract is refused by identity_differences); with checkpoint noise the TP size: its weights are the
    same at every TP size."""
    exact = config.get("restore", common.Config.restore) != "subtract"
    return (RESUME_FREE_FIELDS + (RESTORE_FIELDS if exact else ())
            + (("tensor_parallel_size",) if common.is_checkpoint_noise(config) else ()))


# settings a resume may change (resume_free_fields) that each generation's record carries, so that the history tells
# how every generation ran: the header's config keeps the first run's values. A record written before records carried
# them (an older history) ran with the header's, unless a resume changed them and left no trace.
GENERATION_SETTINGS = RESTORE_FIELDS


def generation_settings(cfg: Config) -> dict:
    """What a generation record carries of the settings it ran with (GENERATION_SETTINGS)."""
    return {field: getattr(cfg, field) for field in GENERATION_SETTINGS}


def without_retired_settings(config: dict) -> dict:
    """A recorded config without `scope` and its `lora_rank`, which a history may record and this code does not
    have: scope="full" (every member perturbs every parameter) is what this code does; any other scope is refused
    (bench/README.md, "Low-rank members", says why there is no other)."""
    if config.get("scope", "full") != "full":
        raise ConfigError(f"the run was trained with scope={config['scope']!r}, which this version of the code no "
                          "longer has (bench/README.md, \"Low-rank members\"): use the version that trained it")
    return {k: v for k, v in config.items() if k not in ("scope", "lora_rank")}


def config_from_history(history: dict, argv: list[str], settings: dict | None = None) -> Config:
    """The constants of a recorded run, for a stage that rebuilds its weights (export, replay). WEIGHT_FIELDS come
    from the history; every other field from `settings` (e.g. an evaluation's sampling and agent settings), else
    from the history. `--preset` fills in only the settings that may differ between runs (RESUME_FREE_FIELDS, such
    as run_dir, and RESTORE_FIELDS: these stages never perturb), never a recorded value; an explicit `--key=value`
    that differs from a recorded one is refused."""
    history_settings = without_retired_settings(history["config"])  # refuses a run this code cannot rebuild
    given = without_retired_settings(settings) if settings else history_settings
    recorded_settings = {k: v for k, v in given.items()
                         if k not in POOL_FIELDS}  # where engines run is this machine's, from the command line
    free_fields = resume_free_fields(history["config"]) + RESTORE_FIELDS
    values = {**recorded_settings, **{f: history["config"][f] for f in WEIGHT_FIELDS
                                      if f in history["config"] and f not in free_fields}}
    unknown = sorted(set(values) - {f.name for f in dataclasses.fields(Config)})
    if unknown:
        raise ConfigError(f"the recorded settings {', '.join(unknown)} are unknown to this version of the code")
    recorded = Config(**values)
    preset, explicit = parse_overrides(argv)
    refused = [f"--{k}={v!r} (recorded: {getattr(recorded, k)!r}{', from the history' if k in WEIGHT_FIELDS else ''})"
               for k, v in explicit.items() if k not in free_fields and v != getattr(recorded, k)]
    if refused:
        raise ConfigError("these settings were recorded by the run and cannot be overridden: " + ", ".join(refused))
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
        **data,
        "base_model": cfg.model,
        "base_model_path": str(model_path),
        "base_fingerprint": model_fingerprint(model_path),
        "base_digests": engine.base_digests(model_path),
        "parameter_names_sha256": engine.parameter_names_sha256(),
        "tensor_parallel_size": cfg.tensor_parallel_size,
        "dtype": cfg.dtype,
        "device_type": engine.device,
        "devices": engine.rpc("es_device"),  # per rank: the noise streams depend on the device model
        "vllm_version": vllm.__version__,
        "torch_version": torch.__version__,
    }


def train_data_sha256(cfg: common.Config) -> str:
    """The training problems' fingerprint: the file's sha256, or for problems made here ("smoke", "learn") the name
    and the sha256 of the problems themselves, so that a history of another version of them is refused."""
    if cfg.train_data not in GENERATED_DATA:
        return sha256_file(cfg.train_data)
    problems = json.dumps(problems_from(cfg.train_data, cfg.run_seed), sort_keys=True).encode()
    return f"{cfg.train_data} {hashlib.sha256(problems).hexdigest()}"


def identity_differences(recorded: dict, current: dict, compare_config: bool = True) -> list[str]:
    """Human-readable differences between a history's identity and this run's (empty: compatible). Without
    compare_config only what defines the weights is compared (base, noise, layout, TP, device, versions)."""
    diffs, any_tp = [], common.is_checkpoint_noise(recorded.get("config", {}))
    for key, value in current.items():
        if not compare_config and key in ("config", "train_data_sha256"):
            continue
        if any_tp and key in ("tensor_parallel_size", "parameter_names_sha256"):
            continue  # checkpoint noise: the same weights at every TP size (the digests compare them)
        if key == "config":
            # a field newer than the history: its default is the old behaviour
            defaults = dataclasses.asdict(common.Config())
            for field, now in value.items():
                then = recorded["config"].get(field, defaults.get(field))
                if field not in resume_free_fields(recorded["config"]) and then != now:
                    older = "" if field in recorded["config"] else " (the default: the history predates the setting)"
                    diffs.append(f"config {field}: history has {then!r}{older}, this run has {now!r}")
                elif field == "restore" and now == "subtract" != then:
                    diffs.append(f"config restore: history has {then!r} (exact), this run has 'subtract' (not exact)")
        elif key == "devices" and any_tp:
            diffs += device_differences(recorded.get(key) and recorded[key][:1], value[:1])
        elif key == "devices":
            diffs += device_differences(recorded.get(key), value)
        elif key == "base_fingerprint" and recorded.get(key) == name_only_fingerprint(recorded.get("base_model")):
            continue  # an older history of a hub id recorded only its name; base_digests still compare the bits
        elif key not in ("base_model_path",) and recorded.get(key) != value:
            diffs.append(f"{key}: history has {recorded.get(key)!r}, this run has {value!r}")
    return diffs


def describe_devices(devices: list[dict]) -> str:
    """Per-rank devices in words: '2 x NVIDIA H200 (132 SMs)'."""
    names = [d["name"] + (f" ({d['sm_count']} SMs)" if d.get("sm_count") else "") for d in devices]
    return ", ".join(f"{names.count(n)} x {n}" for n in dict.fromkeys(names))


def device_differences(recorded: list[dict] | None, current: list[dict]) -> list[str]:
    """CUDA's random streams depend on the GPU model (and torch's CPU normals on its kernel set), so the recorded
    noise exists only on the device model the run was trained on."""
    if recorded is None:
        return [f"devices: the history does not record the device model it was made on (an older history), and "
                f"the noise streams depend on it; this run is on {describe_devices(current)}. If the history was "
                f"made on that model, add \"devices\": {json.dumps(current)} to its header"]
    if recorded != current:
        return [f"devices: the history was made on {describe_devices(recorded)}, this run is on "
                f"{describe_devices(current)}; the noise streams depend on the device model, so resume, export and "
                f"replay only on {describe_devices(recorded)}"]
    return []


def check_base(recorded: dict, current: dict, compare_config: bool = True) -> None:
    """Refuse a history whose base, noise or runtime layout (or, by default, run constants) differ from this
    engine's."""
    diffs = identity_differences(recorded, current, compare_config)
    if diffs:
        raise common.HistoryMismatch("this history was made by a different run:\n  " + "\n  ".join(diffs))


def check_config(recorded: dict, cfg: common.Config) -> None:
    check_base({"config": recorded["config"]}, {"config": dataclasses.asdict(cfg)})


def rebuild_from_history(engine, cfg: Config, model_path: str, history: dict, generations: list[dict],
                         compare_config: bool = True, desc: str = "replaying history") -> tuple[dict, list[str]]:
    """Refuse a history of another base (and, by default, other run constants), then replay `generations` on the
    engine's base weights. Returns this engine's identity and the rebuilt per-rank digests."""
    identity = run_identity(cfg, model_path, engine, train_data=compare_config)
    check_base(history, identity, compare_config)
    return identity, common.replay(engine, progress_bar(generations, desc=desc, leave=False), identity["base_digests"])


# ---- Fingerprints: SHA256SUMS beside published files, the weight files of a base model

SHA256SUMS = "SHA256SUMS"


def sha256_file(path, chunk=1 << 20):
    """Hex sha256 of a file, read in chunks (checkpoint shards are many GB)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _relative_name(folder, file):
    """A file's path relative to folder, with '/' separators, as sha256sum -c expects from inside folder."""
    rel = os.path.relpath(os.path.join(folder, file), folder)
    if rel == os.pardir or rel.startswith(os.pardir + os.sep) or os.path.isabs(rel):
        raise ValueError(f"{file}: not inside {folder}")
    if "\n" in rel or "\\" in rel:
        raise ValueError(f"{file!r}: sha256sum would escape this name; rename it")
    return rel.replace(os.sep, "/")


def write_sha256sums(folder, files):
    """Write folder/SHA256SUMS in `sha256sum` text format ('<hex>  <name>', sorted by name), so
    `cd folder && sha256sum -c SHA256SUMS` checks the published files. files: paths relative to (or inside)
    folder. Returns {name: hex}."""
    names = sorted({_relative_name(folder, f) for f in files} - {SHA256SUMS})
    sums = {name: sha256_file(os.path.join(folder, name)) for name in names}
    fileio.write_file_atomic("".join(f"{sums[name]}  {name}\n" for name in names), os.path.join(folder, SHA256SUMS))
    return sums


def verify_sha256sums(folder):
    """Check every file listed in folder/SHA256SUMS. Returns a list of problems; empty means all match."""
    sums_path = os.path.join(folder, SHA256SUMS)
    if not os.path.isfile(sums_path):
        return [f"{sums_path}: missing"]
    problems = []
    try:
        with open(sums_path, "rb") as f:
            lines = f.read().decode("utf-8").splitlines()
    except UnicodeDecodeError as e:
        return [f"{sums_path}: not UTF-8 text ({e.reason} at byte {e.start})"]
    if not any(line.strip() for line in lines):
        problems.append(f"{sums_path}: lists no files")
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        digest, sep, name = line.partition("  ")
        if not sep:
            digest, sep, name = line.partition(" *")  # binary-mode line, also valid sha256sum output
        if not sep or len(digest) != 64 or any(ch not in "0123456789abcdef" for ch in digest.lower()) or not name:
            problems.append(f"{SHA256SUMS}:{lineno}: malformed line {line!r}")
            continue
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            problems.append(f"{name}: missing")
        elif sha256_file(path) != digest.lower():
            problems.append(f"{name}: sha256 mismatch")
    return problems


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def model_fingerprint(model: str) -> str:
    """sha256 over the weight files of a local model folder (name, size, content), so a history can refuse a
    different base. Hub ids are resolved to their local snapshot folder first (models.resolve_model)."""
    folder = Path(model)
    if not folder.is_dir():
        raise common.ConfigError(f"{model}: not a model folder (models.resolve_model turns a hub id into its local "
                                 "snapshot)")
    h = hashlib.sha256()
    for f in sorted(p for p in folder.iterdir() if p.name.endswith(WEIGHT_SUFFIXES)):
        h.update(f"{f.name}|{f.stat().st_size}|{sha256_file(f)}\n".encode())
    return "sha256:" + h.hexdigest()


def name_only_fingerprint(model: str | None) -> str:
    """What older histories recorded for a hub id: a hash of its name, not of its weights."""
    return "name-only:" + hashlib.sha256(str(model).encode()).hexdigest()


# ---- The sharded_state export: the model's other files beside it, its manifest, checked before anything loads it

def copy_model_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy the non-weight files of a model folder (config, tokenizer, chat template) beside a sharded_state."""
    copied = []
    for f in sorted(Path(src).iterdir()):
        if f.is_file() and not f.name.endswith(WEIGHT_SUFFIXES) and not f.name.endswith(".index.json"):
            shutil.copy2(f, Path(dst) / f.name)
            copied.append(f.name)
    return copied


EXPORT_MANIFEST = "es_sharded_export_manifest.json"
# what eval and replay read from a sharded export's manifest (check_shape)
EXPORT_MANIFEST_SHAPE = {"tensor_parallel_size": None, "shards": [("file", "rank", "sha256")],
                         "per_rank_digests": None, "parameter_names_sha256": None, "replayed_generations": None,
                         "vllm_version": None}
SHARD_PATTERN = re.compile(r"^model-rank-(\d+)-part-(\d+)\.safetensors$")


def shard_entries(folder: str | Path) -> list[dict]:
    """The worker shards vLLM's save_sharded_state wrote: file, rank, bytes, sha256."""
    rows = []
    for f in sorted(Path(folder).iterdir()):
        m = SHARD_PATTERN.match(f.name)
        if m:
            rows.append({"file": f.name, "rank": int(m.group(1)), "part": int(m.group(2)),
                         "bytes": f.stat().st_size, "sha256": sha256_file(f)})
    return rows


def check_loaded_export(engine, manifest: dict, folder) -> list[str]:
    """After loading: the running vLLM must see the exported parameter names and bits, rank by rank."""
    if engine.parameter_names_sha256() != manifest["parameter_names_sha256"]:
        raise ExportError(f"{folder}: this vLLM ({manifest['vllm_version']} wrote the export) lays out the model's "
                          "parameters differently; the sharded state cannot be trusted here")
    digests = engine.digests()
    if digests != manifest["per_rank_digests"]:
        raise ExportError(f"{folder}: loaded per-rank digests {digests} differ from the manifest's "
                          f"{manifest['per_rank_digests']}")
    return digests


def verify_export(folder: str | Path, tensor_parallel_size: int | None = None) -> dict:
    """Check an export folder against its manifest before anything loads it; returns the manifest.
    A wrong TP size, a missing, extra or altered shard, or a damaged file is an ExportError."""
    folder = Path(folder)
    if not (folder / EXPORT_MANIFEST).is_file():
        raise ExportError(f"{folder}: no {EXPORT_MANIFEST}; not an export of 02_export.py")
    manifest = fileio.read_json(folder / EXPORT_MANIFEST, required=EXPORT_MANIFEST_SHAPE)
    tp = manifest["tensor_parallel_size"]
    if tensor_parallel_size is not None and tensor_parallel_size != tp:
        raise ExportError(f"{folder} holds per-rank shards for tensor_parallel_size={tp}; it cannot be loaded "
                          f"with tensor_parallel_size={tensor_parallel_size} (the ranks carry different noise)")
    problems = []
    recorded = {s["file"]: s for s in manifest["shards"]}
    present = {f.name for f in folder.iterdir() if SHARD_PATTERN.match(f.name)}
    problems += [f"missing shard {name}" for name in sorted(set(recorded) - present)]
    problems += [f"unexpected shard {name}" for name in sorted(present - set(recorded))]
    for name in sorted(set(recorded) & present):
        if sha256_file(folder / name) != recorded[name]["sha256"]:
            problems.append(f"shard {name} does not match its sha256 in the manifest")
    if sorted({s["rank"] for s in manifest["shards"]}) != list(range(tp)):
        problems.append(f"manifest shards do not cover ranks 0..{tp - 1}")
    problems += verify_sha256sums(folder) if (folder / SHA256SUMS).exists() else [f"missing {SHA256SUMS}"]
    if problems:
        raise ExportError(f"{folder} failed verification: " + "; ".join(dict.fromkeys(problems)))
    return manifest
