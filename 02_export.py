"""Stage 2: rebuild the trained weights from the base model and the history, and save them.

With the reference's rank-salted noise the trained weights exist only as per-rank shards: they are saved with
save_sharded_state and load only with load_format="sharded_state" at the run's TP size. With noise=checkpoint they
are the same at every TP size and are saved as a Hugging Face safetensors folder (transformers, vLLM at any TP).
Every replayed generation's digests are checked against the history; the first mismatch stops the export.

    python 02_export.py --history=runs/es/es_history.json --out=runs/es/export
    python 02_export.py --replay_generations=10 ...    # export theta after the first 10 generations
    python 02_export.py --verify=runs/es/export        # re-hash an export against its manifest
"""

import dataclasses
import shutil
import time
from pathlib import Path

import common
from agentic_es import checkpoint_noise, cli, fileio, models
from agentic_es.engine import run_stage
from agentic_es.history import (EXPORT_MANIFEST, HISTORY_FILE, SHA256SUMS, config_from_history, copy_model_files,
                                read_history, rebuild_from_history, sha256_file, shard_entries, write_sha256sums)
from agentic_es.pool import EnginePool

HISTORY = ""  # default: <run_dir>/es_history.json (run_dir is a Config field, e.g. set by --preset=smoke)
OUT = ""  # default: <run_dir>/export
REPLAY_GENERATIONS = -1  # replay the first K generations; -1: all of them
VERIFY = ""  # an export folder: check it against its manifest and exit


def main(argv: list[str]) -> Path:
    options = {"history": HISTORY, "out": OUT, "replay_generations": REPLAY_GENERATIONS, "verify": VERIFY}
    cli.exit_if_help(argv, __doc__, __file__, options)
    opts, overrides = cli.parse_args(argv, options)
    if opts["verify"]:
        kind = checkpoint_noise.verify_any_export(opts["verify"])["format"]
        print(f"[export] {opts['verify']} ({kind}): every file matches its SHA256SUMS and manifest")
        return Path(opts["verify"])

    run_dir = Path(cli.parse_config(overrides).run_dir)
    history_path = opts["history"] or run_dir / HISTORY_FILE
    history = read_history(history_path)
    cfg = config_from_history(history, overrides)  # the recorded run; --preset never overrides it
    hf_folder = common.is_checkpoint_noise(cfg)  # the same weights at every TP size: a Hugging Face folder
    generations = select_generations(history, opts["replay_generations"])
    out = Path(opts["out"] or run_dir / "export")
    if out.exists():
        raise common.ExportError(f"{out} already exists; choose another --out (an export is never overwritten)")
    fileio.check_output_path(out, "out")
    fileio.check_output_path(cfg.run_dir, "run_dir")  # vLLM's log goes there

    model_path = models.resolve_model(cfg.model)  # a hub id must be in the local cache: refused here, before any work
    partial = out.with_name(out.name + ".partial")  # becomes `out` only when complete
    shutil.rmtree(partial, ignore_errors=True)
    try:
        # one read-only engine in this process (it saves the shards), planned like every engine
        with EnginePool(dataclasses.replace(cfg, engines=1, ray_address=""), model_path, perturbs=False) as pool:
            engine = pool.engines[0]
            # the base, noise, layout and device must be the history's; the training data is not needed
            identity, digests = rebuild_from_history(engine, cfg, model_path, history, generations,
                                                     compare_config=False,
                                                     desc=f"replaying {len(generations)} generations")
            if hf_folder:
                print("[export] writing the Hugging Face folder: each rank's pieces, then tensor by tensor", flush=True)
                t0 = time.perf_counter()
                files, sums = checkpoint_noise.save_checkpoint(engine, partial)
                print(f"[export] {len(files)} safetensors files in {time.perf_counter() - t0:.1f} s", flush=True)
                # each base tensor: in the folder or in left_out_tensors
                checkpoint_noise.check_held_tensors(model_path, set(sums))
            else:  # rank-salted: the weights exist only as this TP size's shards
                engine.save_sharded_state(partial)
        copy_model_files(model_path, partial)
        if hf_folder:
            checkpoint_noise.set_config_dtype(partial, cfg.dtype)
        write_manifest(partial, history, history_path, generations, digests, identity,
                       sums if hf_folder else None,
                       checkpoint_noise.ignored_checkpoint_tensors(model_path) if hf_folder else None)
        partial.rename(out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    print(f"[export] {out}: theta after {len(generations)} generations, digests {digests}")
    if hf_folder:
        print(f"[export] a Hugging Face folder: AutoModelForCausalLM.from_pretrained({str(out)!r}), or "
              f"LLM(model={str(out)!r}, tensor_parallel_size=any, dtype={cfg.dtype!r})")
    else:
        print(f"[export] load with LLM(model={str(out)!r}, load_format='sharded_state', "
              f"tensor_parallel_size={cfg.tensor_parallel_size}, dtype={cfg.dtype!r})")
    return out


def select_generations(history: dict, k: int) -> list[dict]:
    recorded = history["generations"]
    if k == -1:
        return recorded
    if not 0 <= k <= len(recorded):
        raise common.ConfigError(f"--replay_generations={k}: the history has {len(recorded)} generations")
    return recorded[:k]


def write_manifest(folder: Path, history: dict, history_path: str, generations: list, digests: list,
                   identity: dict, sums: dict | None = None, left_out: dict | None = None) -> None:
    """The export's manifest (what it holds, where it came from) and SHA256SUMS over every file. Rank-salted: the
    per-rank shards of this TP size; checkpoint noise (sums given): the Hugging Face folder's per-tensor digests,
    and the base's tensors it leaves out with the reason (left_out: those every loader ignores)."""
    manifest = {
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "source_history": str(history_path),
        "source_history_sha256": sha256_file(history_path),
        "replayed_generations": len(generations),
        "history_generations": len(history["generations"]),
        "dtype": identity["config"]["dtype"],
        **({"format": "es-hf-export/1", "noise": "checkpoint",
            "digest": digests[0],  # the history's digest of this state, at any TP size
            "tensor_digest_sums": {name: f"{value:016x}" for name, value in sorted(sums.items())},
            "left_out_tensors": dict(sorted((left_out or {}).items())),  # base tensors not in this folder, and why
            "exported_at_tensor_parallel_size": identity["tensor_parallel_size"]} if sums is not None else
           {"format": "es-sharded-export/1", "load_format": "sharded_state",
            "tensor_parallel_size": identity["tensor_parallel_size"], "shards": shard_entries(folder),
            "per_rank_digests": digests, "parameter_names_sha256": identity["parameter_names_sha256"],
            "devices": identity["devices"]}),
        "base_model": identity["base_model"],
        "base_fingerprint": identity["base_fingerprint"],
        "device_type": identity["device_type"],
        "vllm_version": identity["vllm_version"],
        "torch_version": identity["torch_version"],
        "config": history["config"],
    }
    name = checkpoint_noise.HF_EXPORT_MANIFEST if sums is not None else EXPORT_MANIFEST
    fileio.write_json_atomic(manifest, folder / name)
    write_sha256sums(folder, [f.name for f in sorted(folder.iterdir()) if f.name != SHA256SUMS])


if __name__ == "__main__":
    run_stage(main, "export")  # vLLM's log to <run_dir>/vllm.log; errors as one line; SIGTERM/SIGINT stop cleanly
