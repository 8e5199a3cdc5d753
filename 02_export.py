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
from pathlib import Path

from agentic_es import cli, export, fileio, models, stage
from agentic_es.history import (HISTORY_FILE, REBUILD_FIELDS, check_base_files, config_from_history, read_history,
                                rebuild_from_history)
from agentic_es.pool import EnginePool

HISTORY = ""  # default: <run_dir>/es_history.json (run_dir is a Config field, e.g. set by --preset=smoke)
OUT = ""  # default: <run_dir>/export
REPLAY_GENERATIONS = -1  # replay the first K generations; -1: all of them
VERIFY = ""  # an export folder: check it against its manifest and exit


def main(argv: list[str]) -> Path:
    options = {"history": HISTORY, "out": OUT, "replay_generations": REPLAY_GENERATIONS, "verify": VERIFY}
    cli.exit_if_help(argv, __doc__, __file__, options, settings=REBUILD_FIELDS)  # the others: the run's
    opts, overrides = cli.parse_args(argv, options)
    if opts["verify"]:
        kind = export.verify(opts["verify"])["format"]
        print(f"[export] {opts['verify']} ({kind}): every file matches its SHA256SUMS and manifest")
        return Path(opts["verify"])

    run_dir = Path(cli.parse_config(overrides).run_dir)
    history_path = opts["history"] or run_dir / HISTORY_FILE
    history = read_history(history_path)
    cfg = config_from_history(history, overrides)  # the recorded run; --preset never overrides it
    generations = select_generations(history, opts["replay_generations"])
    out = Path(opts["out"] or run_dir / "export")
    if out.exists():
        raise stage.ExportError(f"{out} already exists; choose another --out (an export is never overwritten)")
    fileio.check_output_path(out, "out")
    fileio.check_output_path(cfg.run_dir, "run_dir")  # vLLM's log goes there

    model_path = models.resolve_model(cfg.model)  # a hub id must be in the local cache: refused here, before any work
    check_base_files(history, model_path)  # another base is refused before the engine starts
    partial = out.with_name(out.name + ".partial")  # becomes `out` only when complete
    shutil.rmtree(partial, ignore_errors=True)
    try:
        # one read-only engine in this process (it saves the weights), planned like every engine
        with EnginePool(dataclasses.replace(cfg, engines=1, ray_address=""), model_path, perturbs=False) as pool:
            replay_engine = pool.engines[0]
            # the base, noise, layout and device must be the history's; the training data is not needed
            identity, digests = rebuild_from_history(replay_engine, cfg, model_path, history, generations,
                                                     compare_config=False,
                                                     desc=f"replaying {len(generations)} generations")
            # the format of the run's noise: a sharded_state of this TP size, or a Hugging Face folder
            manifest = export.save(replay_engine, partial, model_path, identity, digests,
                                   export.provenance(history, history_path, generations))
        partial.rename(out)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    print(f"[export] {out}: theta after {len(generations)} generations, digests {digests}")
    print(f"[export] {export.how_to_load(out, manifest)}")
    return out


def select_generations(history: dict, k: int) -> list[dict]:
    recorded = history["generations"]
    if k == -1:
        return recorded
    if not 0 <= k <= len(recorded):
        raise stage.ConfigError(f"--replay_generations={k}: the history has {len(recorded)} generations")
    return recorded[:k]


if __name__ == "__main__":
    # vLLM's log to <run_dir>/vllm.log; errors as one line; SIGTERM/SIGINT stop cleanly
    stage.run_stage(main, "export")
