"""The run history and the manifests: what identifies a run, and the refusals of another run's files.

A history (es_history.json) opens with the run's identity (run_identity): its constants, the noise definition, the
base model's fingerprint and digests, the training data's sha256, the runtime layout, the device model and the
versions. A stage that resumes, exports or replays compares that header with its own (check_base, check_config) and
refuses a history of another run before it changes any weight. Published files carry fingerprints: SHA256SUMS beside
them (`sha256sum -c SHA256SUMS` checks them), and a sharded_state export its manifest (each shard's sha256, the
per-rank digests of the weights), checked before anything loads it (verify_export, check_loaded_export).

The algorithm stays in common: replaying a history's updates (replay, rebuild_from_history), the per-rank weight
digests the TP workers compute, and the atomic JSON and JSONL files. This module imports common; common imports it
only inside the functions that call it, never at import time.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch

import common as C

if TYPE_CHECKING:  # for annotations only
    from common import Engine


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
    history = C.read_json(path, required=HISTORY_SHAPE)
    for i, record in enumerate(history["generations"]):
        where = f"{path}: generations[{i}]"
        if record["generation"] != i:
            raise C.DataError(f"{where} is generation {record['generation']}; a history holds generations 0, 1, "
                              "2, ... in order")
        if {len(record[key]) for key in ("seeds", "rewards", "z")} != {history["config"]["population"]}:
            raise C.DataError(f"{where} has {len(record['seeds'])} seeds, {len(record['rewards'])} rewards and "
                              f"{len(record['z'])} z-scores; the run's population is "
                              f"{history['config']['population']!r}: one of each per member")
    return history


# ---- A run's identity, and the refusals of a history made by another run

def run_identity(cfg: C.Config, model_path: str, engine: Engine, train_data: bool = True) -> dict:
    """The header of a history: what must be equal for a replay to reproduce the trained weights bit for bit.
    Without train_data the training data file is not read (export and replay rebuild theta without it)."""
    import vllm

    import checkpoint_noise  # (it imports this module: imported on use, never at import time)

    data = {}
    if train_data:  # export and replay rebuild theta without the training data file
        data["train_data_sha256"] = train_data_sha256(cfg)
    return {
        "format": HISTORY_FORMAT,
        "config": {k: v for k, v in dataclasses.asdict(cfg).items() if k not in C.POOL_FIELDS},  # any K, one history
        "noise": C.noise_definition(cfg),
        **data,
        "base_model": cfg.model,
        "base_model_path": str(model_path),
        "base_fingerprint": model_fingerprint(model_path),
        "base_digests": (checkpoint_noise.checked_checkpoint_digests(engine, model_path, cfg.dtype)
                         if cfg.noise == "checkpoint" else engine.digests()),
        "parameter_names_sha256": engine.parameter_names_sha256(),
        "tensor_parallel_size": cfg.tensor_parallel_size,
        "dtype": cfg.dtype,
        "device_type": engine.device,
        "devices": engine.rpc("es_device"),  # per rank: the noise streams depend on the device model
        "vllm_version": vllm.__version__,
        "torch_version": torch.__version__,
    }


def train_data_sha256(cfg: C.Config) -> str:
    """The training problems' fingerprint: the file's sha256, or for problems made here ("smoke", "learn") the name
    and the sha256 of the problems themselves, so that a history of another version of them is refused."""
    if cfg.train_data not in C.GENERATED_DATA:
        return sha256_file(cfg.train_data)
    problems = json.dumps(C.problems_from(cfg.train_data, cfg.run_seed), sort_keys=True).encode()
    return f"{cfg.train_data} {hashlib.sha256(problems).hexdigest()}"


def identity_differences(recorded: dict, current: dict, compare_config: bool = True) -> list[str]:
    """Human-readable differences between a history's identity and this run's (empty: compatible). Without
    compare_config only what defines the weights is compared (base, noise, layout, TP, device, versions)."""
    diffs, any_tp = [], recorded.get("noise", {}).get("index") == C.CHECKPOINT_NOISE["index"]
    for key, value in current.items():
        if not compare_config and key in ("config", "train_data_sha256"):
            continue
        if any_tp and key in ("tensor_parallel_size", "parameter_names_sha256"):
            continue  # checkpoint noise: the same weights at every TP size (the digests compare them)
        if key == "config":
            # a field newer than the history: its default is the old behaviour
            defaults = dataclasses.asdict(C.Config())
            for field, now in value.items():
                then = recorded["config"].get(field, defaults.get(field))
                if field not in C.resume_free_fields(recorded["config"]) and then != now:
                    diffs.append(f"config {field}: history has {then!r}, this run has {now!r}")
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
        raise C.HistoryMismatch("this history was made by a different run:\n  " + "\n  ".join(diffs))


def check_config(recorded: dict, cfg: C.Config) -> None:
    check_base({"config": recorded["config"]}, {"config": dataclasses.asdict(cfg)})


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
    C.write_text_atomic("".join(f"{sums[name]}  {name}\n" for name in names), os.path.join(folder, SHA256SUMS))
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
        raise C.ConfigError(f"{model}: not a model folder (models.resolve_model turns a hub id into its local "
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


class ExportError(C.StageError, RuntimeError):
    pass


def shard_entries(folder: str | Path) -> list[dict]:
    """The worker shards vLLM's save_sharded_state wrote: file, rank, bytes, sha256."""
    rows = []
    for f in sorted(Path(folder).iterdir()):
        m = SHARD_PATTERN.match(f.name)
        if m:
            rows.append({"file": f.name, "rank": int(m.group(1)), "part": int(m.group(2)),
                         "bytes": f.stat().st_size, "sha256": sha256_file(f)})
    return rows


def check_loaded_export(engine: Engine, manifest: dict, folder) -> list[str]:
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
    manifest = C.read_json(folder / EXPORT_MANIFEST, required=EXPORT_MANIFEST_SHAPE)
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
