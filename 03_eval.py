"""Stage 3: 16-sample agent evaluation of a checkpoint on DAPO-100 and AIME-2026 (SPEC section 6).

Every problem gets sample_index 0..15, each episode with its own seeds, so any sample can be re-run alone. The
reported row is the group of samples 12-15 (Mean4 / Pass4); the other groups, mean@16 and the unbiased pass@4
show how noisy one group of four is. Finished episodes are appended to a partial file as they end: an interrupted
evaluation resumes without redoing them.

    python 03_eval.py --export=runs/es/export           # the trained weights (checked against the manifest)
    python 03_eval.py --export= --out=runs/es/eval-base # the base model (Config.model), for the before/after table
    python 03_eval.py --preset=smoke                    # the smoke run's export, first 2 smoke problems per set
"""

import contextlib
import dataclasses
import json
from pathlib import Path

import checkpoint_noise
import common as C
import history as H
import sandbox
import models
import engine as E
import pool as P

EXPORT = "<run_dir>/export"  # a folder written by 02_export.py; empty: evaluate the base model itself
OUT = ""  # default: <run_dir>/eval (or <run_dir>/eval-base for the base model)
DATASETS = {  # name -> JSONL (built by 00_data.py); each writes <name>_eval16.json
    "dapo": "data/dapo_test100.jsonl",
    "aime2026": "data/aime2026.jsonl",
}


def main(argv: list[str]) -> dict:
    options = {"export": EXPORT, "out": OUT, **{name: "" for name in DATASETS}}  # --dapo=PATH: another file
    C.exit_if_help(argv, __doc__, __file__, options)
    opts, overrides = C.parse_args(argv, options)
    cfg = C.parse_config(overrides)
    export = opts["export"].replace("<run_dir>", cfg.run_dir)
    if not export:
        cfg = base_config(cfg, overrides)
    out = Path(opts["out"] or Path(cfg.run_dir) / ("eval" if export else "eval-base"))
    data = data_paths(opts, cfg)
    datasets = {name: eval_problems(data[name], cfg) for name in DATASETS}
    C.check_output_path(cfg.run_dir, "run_dir")
    C.check_output_path(out, "out")
    check_finished_episodes(out)
    sandbox.check_sandbox(cfg.run_dir, data=list(data.values()), checkpoint=export,  # (unless allowed)
                          allow_leaks=cfg.allow_leaky_sandbox, error=C.ConfigError)
    # before any writing
    manifest = checkpoint_noise.verify_any_export(export, cfg.tensor_parallel_size) if export else None
    if manifest:  # the loaded bits are checked, and recorded, in the digests of the export's noise
        cfg = dataclasses.replace(cfg, noise=manifest.get("noise", "rank_salted"))
    if not export:
        models.resolve_model(cfg.model)  # a hub id that is not in the local cache is refused before anything is written

    with open_checkpoint(cfg, export, manifest) as (engine, checkpoint):
        out.mkdir(parents=True, exist_ok=True)  # once the engine runs: a refused setting leaves no folder behind
        claim_output_folder(out, checkpoint, cfg, data)
        metrics = {"checkpoint": checkpoint, "samples": C.EVAL_SAMPLES, "reported_group": C.REPORTED_GROUP,
                   "datasets": {}}
        for name, problems in datasets.items():
            records = evaluate(engine, problems, range(C.EVAL_SAMPLES), out / f"{name}_episodes.jsonl", name)
            C.write_json_atomic({"dataset": name, "data": data[name], "checkpoint": checkpoint,
                                 "config": dataclasses.asdict(cfg), "records": strip_transcripts(records)},
                                out / f"{name}_eval16.json")
            C.write_transcripts_markdown(records, out / f"{name}_failed.md")
            metrics["datasets"][name] = C.dataset_metrics(records)
    C.write_json_atomic(metrics, out / C.EVAL_METRICS)  # last: the evaluation is complete
    print(C.format_metrics_table(metrics["datasets"]))
    print(f"[eval] wrote {out}/{{{','.join(DATASETS)}}}_eval16.json and {C.EVAL_METRICS}")
    return metrics


def check_finished_episodes(out: Path) -> None:
    """The files a resumed evaluation keeps, read before the engine starts: a damaged one is refused now, not after
    minutes of loading."""
    if (out / "eval_run.json").exists():
        C.read_json(out / "eval_run.json", required=("checkpoint", "config", "data"))
    for name in DATASETS:
        if (out / f"{name}_episodes.jsonl").exists():
            C.read_jsonl(out / f"{name}_episodes.jsonl", required=C.EPISODE_RECORD_KEYS)


def base_config(cfg, overrides: list[str]):
    """For the base model: when the run dir holds the history of a run from this base, that history's settings
    that define the weights and their digests (WEIGHT_FIELDS: the noise kind, the TP size, the dtype), as export
    and replay take them, so that the evaluation records the digests 04_replay rebuilds. An explicit --key=value
    that contradicts the history is refused."""
    path = Path(cfg.run_dir) / H.HISTORY_FILE
    if not path.exists():
        return cfg
    history = C.read_json(path)
    if history["config"].get("model") != cfg.model:
        return cfg
    return C.config_from_history(history, overrides, settings=dataclasses.asdict(cfg))


def data_paths(opts: dict, cfg) -> dict:
    """Each set's --name=PATH if given, else "smoke" (the smoke problems) with smoke_eval, else DATASETS."""
    return {name: opts[name] or ("smoke" if cfg.smoke_eval else DATASETS[name]) for name in DATASETS}


def eval_problems(path: str, cfg) -> list[dict]:
    problems = C.problems_from(path, cfg.run_seed)
    return problems[:cfg.eval_problems] if cfg.eval_problems else problems


@contextlib.contextmanager
def open_checkpoint(cfg, export: str, manifest: dict | None):
    """An engine holding the export (its files verified against the manifest before; its loaded bits checked
    after loading) or, without an export, the base model."""
    if not export:
        with P.EnginePool(cfg, models.resolve_model(cfg.model)) as engine:
            yield engine, {"kind": "base", "model": cfg.model, "per_rank_digests": engine.digests()}
        return
    if manifest.get("noise") == "checkpoint":  # a Hugging Face folder: any TP size, digests in checkpoint terms
        with P.EnginePool(cfg, export) as engine:
            loaded = engine.digests()
            if loaded != [manifest["digest"]]:
                raise H.ExportError(f"{export}: loaded digest {loaded[0]} differs from the manifest's "
                                    f"{manifest['digest']}")
            yield engine, {"kind": "export", "path": export, "replayed_generations": manifest["replayed_generations"],
                           "manifest_sha256": H.sha256_file(Path(export) / checkpoint_noise.HF_EXPORT_MANIFEST),
                           "per_rank_digests": loaded}
        return
    with P.EnginePool(cfg, export, load_format="sharded_state", tokenizer=export) as engine:
        loaded = H.check_loaded_export(engine, manifest, export)  # the bits vLLM holds are the exported ones
        yield engine, {"kind": "export", "path": export, "replayed_generations": manifest["replayed_generations"],
                       "manifest_sha256": H.sha256_file(Path(export) / H.EXPORT_MANIFEST),
                       "per_rank_digests": loaded}


def claim_output_folder(out: Path, checkpoint: dict, cfg, data: dict) -> None:
    """Finished episodes in `out` are reused on resume, so they must belong to this checkpoint, data and settings;
    the settings that only say where files go or how fast the engine steps (RESUME_FREE_FIELDS) may differ."""
    def settings(config: dict) -> dict:
        return {k: v for k, v in config.items() if k not in C.RESUME_FREE_FIELDS}

    run = json.loads(json.dumps({"checkpoint": checkpoint, "config": settings(dataclasses.asdict(cfg)),
                                 "data": data}))
    marker = out / "eval_run.json"
    if marker.exists():
        recorded = C.read_json(marker)
        if dict(recorded, config=settings(recorded.get("config", {}))) != run:
            raise C.ConfigError(f"{out} holds an evaluation of another checkpoint or config; choose another --out")
    C.write_json_atomic(run, marker)


def evaluate(engine, problems: list[dict], sample_indices, log: Path, name: str) -> list[dict]:
    """All (problem, sample) episodes. Each finished episode (with its transcript) is appended to `log` as it
    ends; the ones already there are kept, not re-run."""
    finished = C.read_jsonl(log, required=C.EPISODE_RECORD_KEYS) if log.exists() else []
    done = {(r["problem_id"], r["sample_index"]): r for r in finished}
    todo = [(p, i) for p in problems for i in sample_indices if (p["id"], i) not in done]
    if done:
        print(f"[eval] {name}: resuming, {len(done)} episodes already finished, {len(todo)} to go")
    try:
        records = engine.run_agent(todo, desc=f"{name} episodes", on_record=lambda r: C.append_jsonl(log, [r]))
    except (C.EngineFailure, E.Interrupted) as stop:
        finished = len(C.read_jsonl(log)) if log.exists() else 0
        print(f"[eval] {name}: stopped ({stop}); {log} keeps the {finished} finished episodes: run the same "
              "command again to resume")
        raise
    for record in records:
        done[(record["problem_id"], record["sample_index"])] = record
    return [done[(p["id"], i)] for p in problems for i in sample_indices]


def strip_transcripts(records: list[dict]) -> list[dict]:
    """The eval16 files hold the SPEC section 6 fields; transcripts stay in <name>_episodes.jsonl and the .md."""
    return [{k: v for k, v in r.items() if k != "messages"} for r in records]


if __name__ == "__main__":
    E.run_stage(main, "eval")  # vLLM's log to <run_dir>/vllm.log; errors as one line; SIGTERM/SIGINT stop cleanly
