"""Exports: a run's trained weights as files that load without its history, in the one format its noise allows, behind
one interface for both formats:

    manifest = export.save(replay_engine, folder, model_path, identity, digests,
                           export.provenance(history, history_path, generations))  # 02_export
    manifest = export.verify(folder, tensor_parallel_size)    # before anything loads it; a damaged one: one line
    cfg = dataclasses.replace(cfg, noise=export.digest_noise(manifest))  # the kind of digests the manifest records
    with EnginePool(cfg, **export.load(folder, manifest), perturbs=False) as engines:
        loaded = export.check_loaded(engines, folder, manifest)          # the loaded bits are the exported ones

The two formats. A rank-salted run's weights (the reference's noise) exist only as one TP size's per-rank shards: a
sharded_state folder (vLLM's save_sharded_state; it loads only with load_format="sharded_state" at that TP size),
its manifest es_sharded_export_manifest.json listing each shard's sha256 and the per-rank digests. A
checkpoint-noise run's weights are the same at every TP size: a Hugging Face folder (safetensors by checkpoint name;
transformers, and vLLM at any TP size), its manifest es_export_manifest.json holding the digest in checkpoint terms
and each tensor's digest sum. Either also holds the base model's other files (config, tokenizer, chat template) and
SHA256SUMS over every file (`sha256sum -c SHA256SUMS`).

This module imports common, fileio, checkpoint_noise and history; none of them imports it.
"""

from __future__ import annotations

import math
import re
import shutil
import time
from pathlib import Path

import torch

import common
from agentic_es import checkpoint_noise, fileio, stage
from agentic_es.history import config_as_trained

SHARDED_STATE = "es-sharded-export/1"  # a manifest's "format": per-rank shards of one TP size (rank-salted noise)
HUGGING_FACE = "es-hf-export/1"  # ... a Hugging Face folder, any TP size (checkpoint noise)
SHARDED_STATE_MANIFEST = "es_sharded_export_manifest.json"
HUGGING_FACE_MANIFEST = "es_export_manifest.json"
# what eval and replay read from each manifest (check_shape)
SHARDED_STATE_MANIFEST_SHAPE = {"tensor_parallel_size": None, "shards": [("file", "rank", "sha256")],
                                "per_rank_digests": None, "parameter_names_sha256": None,
                                "replayed_generations": None, "vllm_version": None}
HUGGING_FACE_MANIFEST_SHAPE = ("digest", "replayed_generations")


# ---- The interface: what the stages call, for either format

def save(engine, folder: str | Path, model_path: str, identity: dict, digests: list[str], source: dict) -> dict:
    """The weights `engine` holds (an engine.Engine at the replayed state; `digests` its digests, `identity` its
    run_identity) into `folder` in the format of the run's noise, with the base's other files, the manifest and
    SHA256SUMS. source: where the weights came from (provenance). Returns the manifest."""
    folder = Path(folder)
    if common.is_checkpoint_noise(identity["config"]):
        weights = save_hugging_face(engine, folder, model_path, identity, digests)
    else:
        weights = save_sharded_state(engine, folder, model_path, identity, digests)
    return write_manifest(folder, source, identity, weights)


def provenance(history: dict, history_path: str | Path, generations: list[dict]) -> dict:
    """What a manifest records of where its weights came from: the history (path, sha256, its config, with the
    fitness its run trained on where it predates the setting: history.config_as_trained) and how many of its
    generations were replayed."""
    return {"source_history": str(history_path), "source_history_sha256": fileio.sha256_file(history_path),
            "replayed_generations": len(generations), "history_generations": len(history["generations"]),
            "config": config_as_trained(history)}


def verify(folder: str | Path, tensor_parallel_size: int | None = None) -> dict:
    """Check an export folder against its manifest and SHA256SUMS before anything loads it; returns the manifest. A
    sharded_state export holds one TP size (refused at another `tensor_parallel_size`), a Hugging Face folder loads
    at any. A missing, extra or altered file, or a manifest without what the stages read, is an ExportError (a
    DataError for the manifest) in one line."""
    if (Path(folder) / HUGGING_FACE_MANIFEST).is_file():
        return verify_hugging_face(folder)
    return verify_sharded_state(folder, tensor_parallel_size)


def manifest_file(folder: str | Path) -> Path:
    """The manifest of an export folder (verify has checked it)."""
    hugging_face = (Path(folder) / HUGGING_FACE_MANIFEST).is_file()
    return Path(folder) / (HUGGING_FACE_MANIFEST if hugging_face else SHARDED_STATE_MANIFEST)


def load(folder: str | Path, manifest: dict) -> dict:
    """EnginePool's model path and loading arguments for a verified export: a sharded_state folder loads with
    load_format="sharded_state" and the tokenizer beside its shards, a Hugging Face folder as any model does."""
    if is_hugging_face(manifest):
        return {"model_path": str(folder)}
    return {"model_path": str(folder), "load_format": "sharded_state", "tokenizer": str(folder)}


def digest_noise(manifest: dict) -> str:
    """The noise whose digests the manifest records: engines holding the export run with it (cfg.noise), so that
    their digests are of the same kind (checkpoint: one digest at any TP size; rank_salted: one per rank)."""
    return "checkpoint" if is_hugging_face(manifest) else "rank_salted"


def digests(manifest: dict) -> list[str]:
    """The exported weights' digests as the history and the engines give them: one in checkpoint terms, or one per
    TP rank."""
    return [manifest["digest"]] if is_hugging_face(manifest) else manifest["per_rank_digests"]


def check_loaded(engines, folder: str | Path, manifest: dict) -> list[str]:
    """After loading: the running vLLM must hold the exported bits (rank by rank for a sharded_state, whose
    parameter layout must also be the one it was saved from). Returns the loaded digests."""
    if not is_hugging_face(manifest) and engines.parameter_names_sha256() != manifest["parameter_names_sha256"]:
        raise stage.ExportError(f"{folder}: this vLLM ({manifest['vllm_version']} wrote the export) lays out the "
                                "model's parameters differently; the sharded state cannot be trusted here")
    loaded = engines.digests()
    if loaded != digests(manifest):
        raise stage.ExportError(f"{folder}: loaded digests {loaded} differ from the manifest's {digests(manifest)}")
    return loaded


def how_to_load(folder: str | Path, manifest: dict) -> str:
    """How a user loads the export, in one line."""
    if is_hugging_face(manifest):
        return (f"a Hugging Face folder: AutoModelForCausalLM.from_pretrained({str(folder)!r}), or "
                f"LLM(model={str(folder)!r}, tensor_parallel_size=any, dtype={manifest['dtype']!r})")
    return (f"load with LLM(model={str(folder)!r}, load_format='sharded_state', "
            f"tensor_parallel_size={manifest['tensor_parallel_size']}, dtype={manifest['dtype']!r})")


def is_hugging_face(manifest: dict) -> bool:
    """Whether a manifest is a Hugging Face folder's (a checkpoint-noise run's)."""
    return common.is_checkpoint_noise(manifest)


# ---- What every export holds besides its weights: the base's other files, the manifest, SHA256SUMS

def copy_model_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy the non-weight files of a model folder (config, tokenizer, chat template) beside exported weights."""
    copied = []
    for f in sorted(Path(src).iterdir()):
        if f.is_file() and not f.name.endswith(fileio.WEIGHT_SUFFIXES) and not f.name.endswith(".index.json"):
            shutil.copy2(f, Path(dst) / f.name)
            copied.append(f.name)
    return copied


def write_manifest(folder: Path, source: dict, identity: dict, weights: dict) -> dict:
    """The export's manifest (what it holds, where it came from: provenance) and SHA256SUMS over every file.
    weights: the format's own fields (sharded_state_fields, hugging_face_fields). Returns the manifest."""
    manifest = {
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        **{k: v for k, v in source.items() if k != "config"},
        "dtype": identity["config"]["dtype"],
        **weights,
        "base_model": identity["base_model"],
        "base_fingerprint": identity["base_fingerprint"],
        "device_type": identity["device_type"],
        "vllm_version": identity["vllm_version"],
        "torch_version": identity["torch_version"],
        "config": source["config"],
    }
    name = HUGGING_FACE_MANIFEST if weights["format"] == HUGGING_FACE else SHARDED_STATE_MANIFEST
    fileio.write_json_atomic(manifest, folder / name)
    shards = {s["file"]: s["sha256"] for s in weights.get("shards", [])}  # hashed just now: not read again
    fileio.write_sha256sums(folder, [f.name for f in sorted(folder.iterdir()) if f.name != fileio.SHA256SUMS], shards)
    return manifest


# ---- sharded_state: a rank-salted run's per-rank shards of its TP size

SHARD_PATTERN = re.compile(r"^model-rank-(\d+)-part-(\d+)\.safetensors$")


def save_sharded_state(engine, folder: Path, model_path: str, identity: dict, digests: list[str]) -> dict:
    """vLLM's save_sharded_state and the base's other files; returns the manifest's fields of this format."""
    engine.save_sharded_state(folder)
    copy_model_files(model_path, folder)
    return sharded_state_fields(folder, identity, digests)


def sharded_state_fields(folder: Path, identity: dict, digests: list[str]) -> dict:
    """A sharded_state manifest's own fields: the shards of this TP size, their per-rank digests and the runtime
    layout they were saved from."""
    return {"format": SHARDED_STATE, "load_format": "sharded_state",
            "tensor_parallel_size": identity["tensor_parallel_size"], "shards": shard_entries(folder),
            "per_rank_digests": digests, "parameter_names_sha256": identity["parameter_names_sha256"],
            "devices": identity["devices"]}


def shard_entries(folder: str | Path) -> list[dict]:
    """The worker shards vLLM's save_sharded_state wrote: file, rank, bytes, sha256."""
    rows = []
    for f in sorted(Path(folder).iterdir()):
        m = SHARD_PATTERN.match(f.name)
        if m:
            rows.append({"file": f.name, "rank": int(m.group(1)), "part": int(m.group(2)),
                         "bytes": f.stat().st_size, "sha256": fileio.sha256_file(f)})
    return rows


def verify_sharded_state(folder: str | Path, tensor_parallel_size: int | None = None) -> dict:
    """verify for a sharded_state export: a wrong TP size, a missing, extra or altered shard, or a damaged file is
    an ExportError."""
    folder = Path(folder)
    if not (folder / SHARDED_STATE_MANIFEST).is_file():
        raise stage.ExportError(f"{folder}: no {SHARDED_STATE_MANIFEST}; not an export of 02_export.py")
    manifest = fileio.read_json(folder / SHARDED_STATE_MANIFEST, required=SHARDED_STATE_MANIFEST_SHAPE)
    tp = manifest["tensor_parallel_size"]
    if tensor_parallel_size is not None and tensor_parallel_size != tp:
        raise stage.ExportError(f"{folder} holds per-rank shards for tensor_parallel_size={tp}; it cannot be loaded "
                                f"with tensor_parallel_size={tensor_parallel_size} (the ranks carry different noise)")
    problems = []
    recorded = {s["file"]: s for s in manifest["shards"]}
    present = {f.name for f in folder.iterdir() if SHARD_PATTERN.match(f.name)}
    problems += [f"missing shard {name}" for name in sorted(set(recorded) - present)]
    problems += [f"unexpected shard {name}" for name in sorted(present - set(recorded))]
    actual = {name: fileio.sha256_file(folder / name) for name in sorted(set(recorded) & present)}  # once each
    problems += [f"shard {name} does not match its sha256 in the manifest"
                 for name, digest in actual.items() if digest != recorded[name]["sha256"]]
    if sorted({s["rank"] for s in manifest["shards"]}) != list(range(tp)):
        problems.append(f"manifest shards do not cover ranks 0..{tp - 1}")
    problems += sha256sums_problems(folder, actual)
    if problems:
        raise stage.ExportError(f"{folder} failed verification: " + "; ".join(dict.fromkeys(problems)))
    return manifest


def sha256sums_problems(folder: Path, known: dict[str, str] | None = None) -> list[str]:
    """What differs from the folder's SHA256SUMS, which every export holds; known: the sha256 of files just read."""
    if not (folder / fileio.SHA256SUMS).exists():
        return [f"missing {fileio.SHA256SUMS}"]
    return fileio.verify_sha256sums(folder, known)


# ---- Hugging Face: a checkpoint-noise run's weights by checkpoint name, written at any TP size

HF_FILE_BYTES = 4 * 1024**3  # a safetensors file per ~4 GiB, with an index beside them when there are several
PIECES = ".pieces"  # inside an export being written: each rank's owned segments (es_write_checkpoint_pieces)


def save_hugging_face(engine, folder: Path, model_path: str, identity: dict, digests: list[str]) -> dict:
    """The Hugging Face folder (write_checkpoint_tensors), the base's other files with config.json naming the run's
    dtype; returns the manifest's fields of this format, with the base's tensors it leaves out and why."""
    print("[export] writing the Hugging Face folder: each rank's pieces, then tensor by tensor", flush=True)
    t0 = time.perf_counter()
    files, sums = write_checkpoint_tensors(engine, folder)
    print(f"[export] {len(files)} safetensors files in {time.perf_counter() - t0:.1f} s", flush=True)
    checkpoint_noise.check_held_tensors(model_path, set(sums))  # each base tensor: in the folder or left out
    copy_model_files(model_path, folder)
    set_config_dtype(folder, identity["config"]["dtype"])
    return hugging_face_fields(identity, digests, sums, checkpoint_noise.ignored_checkpoint_tensors(model_path))


def hugging_face_fields(identity: dict, digests: list[str], sums: dict[str, int], left_out: dict[str, str]) -> dict:
    """A Hugging Face manifest's own fields: the digest in checkpoint terms, each tensor's digest sum, the base's
    tensors left out with the reason (those every loader ignores) and the TP size it was written at."""
    return {"format": HUGGING_FACE, "noise": "checkpoint",
            "digest": digests[0],  # the history's digest of this state, at any TP size
            "tensor_digest_sums": {name: f"{value:016x}" for name, value in sorted(sums.items())},
            "left_out_tensors": dict(sorted(left_out.items())),  # base tensors not in this folder, and why
            "exported_at_tensor_parallel_size": identity["tensor_parallel_size"]}


def write_checkpoint_tensors(engine, folder: Path) -> tuple[list[str], dict[str, int]]:
    """The engine's weights as Hugging Face safetensors by checkpoint name (files, digest sums): each rank writes the
    segments it owns (es_write_checkpoint_pieces), and they are put together here tensor by tensor."""
    pieces = folder / PIECES
    pieces.mkdir(parents=True, exist_ok=True)
    try:
        engine.rpc(checkpoint_noise.CheckpointESWorker.es_write_checkpoint_pieces, folder=str(pieces))
        sums, shapes = engine.checkpoint_sums()
        names = engine.rpc(checkpoint_noise.CheckpointESWorker.es_checkpoint_names)[0]
        files = write_safetensors_files(assembled_tensors(pieces, names, shapes), folder)
    finally:
        shutil.rmtree(pieces, ignore_errors=True)
    return files, sums


def assembled_tensors(pieces: Path, names: list[str], shapes: dict[str, list[int]]):
    """(name, tensor) in checkpoint order, each put together from the ranks' owned segments."""
    from safetensors import safe_open

    files = [safe_open(str(f), framework="pt") for f in sorted(pieces.glob("pieces-rank-*.safetensors"))]
    for tid, name in enumerate(names):
        if name not in shapes:
            continue
        out, filled = None, 0
        for f in files:
            if f"{tid}.values" not in f.keys():
                continue
            values, segments = f.get_tensor(f"{tid}.values"), f.get_tensor(f"{tid}.segments").tolist()
            out = torch.empty(math.prod(shapes[name]), dtype=values.dtype) if out is None else out
            at = 0
            for start, length in segments:
                out[start:start + length] = values[at:at + length]
                at, filled = at + length, filled + length
        if filled != math.prod(shapes[name]):
            raise stage.ExportError(f"{name}: the ranks' pieces hold {filled} of {math.prod(shapes[name])} elements")
        yield name, out.view(shapes[name])


def write_safetensors_files(tensors, folder: Path) -> list[str]:
    """Hugging Face's layout: model.safetensors, or model-0000k-of-0000n.safetensors and their index."""
    from safetensors.torch import save_file

    groups, group, size = [], {}, 0
    for name, t in tensors:
        if group and size + t.numel() * t.element_size() > HF_FILE_BYTES:
            groups.append(group)
            group, size = {}, 0
        group[name], size = t.contiguous(), size + t.numel() * t.element_size()
    groups.append(group)
    if len(groups) == 1:
        save_file(groups[0], str(folder / "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    files, weight_map = [], {}
    for k, g in enumerate(groups, start=1):
        files.append(f"model-{k:05d}-of-{len(groups):05d}.safetensors")
        save_file(g, str(folder / files[-1]), metadata={"format": "pt"})
        weight_map.update({name: files[-1] for name in g})
    fileio.write_json_atomic({"metadata": {}, "weight_map": weight_map}, folder / "model.safetensors.index.json")
    return files + ["model.safetensors.index.json"]


def set_config_dtype(folder: Path, dtype: str) -> None:
    """config.json names the exported weights' dtype (transformers and vLLM read it as the default)."""
    config = fileio.read_json(folder / "config.json")
    config.update({k: dtype for k in ("torch_dtype", "dtype") if k in config} or {"torch_dtype": dtype})
    fileio.write_json_atomic(config, folder / "config.json")


def verify_hugging_face(folder: str | Path) -> dict:
    """verify for a Hugging Face export: every file against its SHA256SUMS."""
    folder = Path(folder)
    if not (folder / HUGGING_FACE_MANIFEST).is_file():
        raise stage.ExportError(f"{folder}: no {HUGGING_FACE_MANIFEST}; not a checkpoint-noise export of 02_export.py")
    problems = sha256sums_problems(folder)
    if problems:
        raise stage.ExportError(f"{folder} failed verification: " + "; ".join(dict.fromkeys(problems)))
    return fileio.read_json(folder / HUGGING_FACE_MANIFEST, required=HUGGING_FACE_MANIFEST_SHAPE)
