"""Stage 3: 16-sample agent evaluation of a checkpoint on DAPO-100 and AIME-2026 (the learn task: its held-out
additions; the compute task: its held-out parameters and held-out families).

Every problem gets sample_index 0..15, each episode with its own seeds, so any sample can be re-run alone. The
reported row is the group of samples 12-15 (Mean4 / Pass4); the other groups, mean@16 (the accuracy) and the
unbiased pass@4 show how noisy one group of four is; beside them the mean reward of the run's --fitness when it
is not the agent's score. Finished episodes are appended to a partial file as they end: an interrupted evaluation
resumes without redoing them.

    python 03_eval.py --export=runs/es/export           # the trained weights (checked against the manifest)
    python 03_eval.py --export= --out=runs/es/eval-base # the base model (Config.model), for the before/after table
    python 03_eval.py --preset=smoke                    # the smoke run's export, first 2 smoke problems per set
    python 03_eval.py --preset=learn                    # the learn run's export on 64 held-out additions
    python 03_eval.py --preset=strict                   # the strict run's export on 64 held-out sums of its tier
    python 03_eval.py --preset=compute                  # the compute run's export on 64 + 64 held-out problems
    python 03_eval.py --preset=compute --train_data=data/dapo_train400.jsonl --sets=dapo --eval_problems=32 \
        --max_turns=10 --max_new_tokens=2048 --max_model_len=24576 --out=runs/compute/eval-dapo
                                                        # what carries over: the compute run's export on DAPO alone

An evaluation of a run's weights (its export, or the base model in a run folder holding its history) evaluates the
tier and level of the task the run trained on (TASK_FIELDS: learn_digits, compute_level), as its history recorded
them; a --learn_digits or --compute_level of another value is refused.
"""

import contextlib
import dataclasses
import json
import re
from pathlib import Path

import common
from agentic_es import cli, export, fileio, models, stage, upgrade
from agentic_es.data import TASKS, problems_from, problems_sha256
from agentic_es.history import (EXECUTION_FIELDS, HISTORY_FILE, RESTORE_FIELDS, config_from_history,
                                field_differences, read_history)
from agentic_es.metrics import EPISODE_RECORD_KEYS, EVAL_METRICS, EVAL_SAMPLES, REPORTED_GROUP, dataset_metrics
from agentic_es.pool import EnginePool

EXPORT = "<run_dir>/export"  # a folder written by 02_export.py; empty: evaluate the base model itself
OUT = ""  # default: <run_dir>/eval (or <run_dir>/eval-base for the base model)
SETS = ""  # comma-separated: only these of the run's sets (e.g. "dapo"); empty: every one
DATASETS = {  # name -> JSONL (built by 00_data.py); each writes <name>_eval16.json
    "dapo": "data/dapo_test100.jsonl",
    "aime2026": "data/aime2026.jsonl",
}
# train_data -> the sets of a task made here (data.TASKS, each task's EVAL_SETS); other runs: DATASETS
TASK_SETS = {name: task.EVAL_SETS for name, task in TASKS.items() if task.EVAL_SETS}
ALL_DATASETS = {**DATASETS, **{name: path for sets in TASK_SETS.values() for name, path in sets.items()}}
TASK_FIELDS = ("learn_digits", "compute_level")  # which tier or level of a task made here the sets are of


def main(argv: list[str]) -> dict:
    options = {"export": EXPORT, "out": OUT, "sets": SETS, **{name: "" for name in ALL_DATASETS}}  # --dapo=PATH
    cli.exit_if_help(argv, __doc__, __file__, options)
    opts, overrides = cli.parse_args(argv, options)
    cfg = cli.parse_config(overrides)
    export_dir = opts["export"].replace("<run_dir>", cfg.run_dir)
    if not export_dir:
        cfg = base_config(cfg, overrides)
    else:
        cfg = exported_task(cfg, export_dir, overrides)
    out = Path(opts["out"] or Path(cfg.run_dir) / ("eval" if export_dir else "eval-base"))
    data = data_paths(opts, cfg)
    datasets = {name: eval_problems(path, cfg) for name, path in data.items()}
    data_sha256 = {name: problems_sha256(path, cfg.run_seed, cfg.learn_digits, cfg.compute_level)
                   for name, path in data.items()}
    fileio.check_output_path(cfg.run_dir, "run_dir")
    fileio.check_output_path(out, "out")
    check_finished_episodes(out, data, data_sha256, common.reward_definition(cfg.fitness))
    common.check_sandbox(cfg, data=list(data.values()), checkpoint=export_dir)  # (unless allowed)
    # before any writing
    manifest = export.verify(export_dir, cfg.tensor_parallel_size) if export_dir else None
    if manifest:  # the loaded bits are checked, and recorded, in the digests of the export's noise
        cfg = dataclasses.replace(cfg, noise=export.digest_noise(manifest))
    if not export_dir:
        models.resolve_model(cfg.model)  # a hub id that is not in the local cache is refused before anything is written

    stage.check_scorer()  # a scorer that cannot start or scores known answers wrongly is refused before vLLM starts
    with open_checkpoint(cfg, export_dir, manifest) as (engines, checkpoint):
        out.mkdir(parents=True, exist_ok=True)  # once the engines run: a refused setting leaves no folder behind
        claim_output_folder(out, checkpoint, cfg, data, data_sha256)
        metrics = {"checkpoint": checkpoint, "samples": EVAL_SAMPLES, "reported_group": REPORTED_GROUP,
                   "datasets": {}}
        for name, problems in datasets.items():
            records = evaluate(engines, problems, range(EVAL_SAMPLES), out / f"{name}_episodes.jsonl", name)
            fileio.write_json_atomic({"dataset": name, "data": data[name], "data_sha256": data_sha256[name],
                                      "checkpoint": checkpoint, "config": dataclasses.asdict(cfg),
                                      "reward": common.reward_definition(cfg.fitness),  # how it scored them
                                      "records": strip_transcripts(records, cfg.fitness)},
                                     out / f"{name}_eval16.json")
            write_transcripts_markdown(records, out / f"{name}_failed.md")
            metrics["datasets"][name] = dataset_metrics(records, cfg.fitness)
    fileio.write_json_atomic(metrics, out / EVAL_METRICS)  # last: the evaluation is complete
    print(format_metrics_table(metrics["datasets"]))
    for name, m in metrics["datasets"].items():
        if any(m["scorer_failures"].values()):
            print(f"[eval] {name}: the scorer failed on " + ", ".join(
                f"{n} episodes ({method})" for method, n in m["scorer_failures"].items() if n) + ", scored 0")
    print(format_cut_replies(metrics["datasets"]))
    print(f"[eval] wrote {out}/{{{','.join(data)}}}_eval16.json and {EVAL_METRICS}")
    return metrics


def check_finished_episodes(out: Path, data: dict, data_sha256: dict, reward: dict) -> None:
    """The files a resumed evaluation keeps, read before the engine starts: a damaged one is refused now, not after
    minutes of loading, and so is a data file that changed since the evaluation began (by its sha256; a marker
    written before markers recorded it holds the paths only, which claim_output_folder compares as before), and a
    reward definition (common.reward_definition) other than the one its episodes were scored under (a marker
    written before markers recorded it: not compared)."""
    marker = out / "eval_run.json"
    if marker.exists():
        run = upgrade.upgraded(fileio.read_json(marker, required=("checkpoint", "config", "data")),
                               upgrade.EVALUATION_KEYS_ADDED)
        if run["reward"] is not None and (differences := common.reward_differences(run["reward"], reward, marker.name,
                                                                                   "this evaluation")):
            raise stage.ConfigError(f"{out} holds episodes scored under another reward definition: "
                                    + "; ".join(differences) + "; evaluate into another --out")
        recorded = run["data_sha256"]
        if recorded is None:
            print(f"[eval] {marker} records its data by path only (written before data sha256s): the paths are "
                  "compared, the content cannot be; its data's sha256s are recorded from now on")
        for name, then in (recorded or {}).items():
            if name in data_sha256 and data_sha256[name] != then:
                raise stage.DataError(f"{data[name]}: sha256 {data_sha256[name]} differs from the {then} that "
                                      f"{marker} recorded for {name}: the data changed since this evaluation "
                                      "began; restore it or choose another --out")
    for name in ALL_DATASETS:
        if (out / f"{name}_episodes.jsonl").exists():
            fileio.read_jsonl(out / f"{name}_episodes.jsonl", required=EPISODE_RECORD_KEYS)


def base_config(cfg, overrides: list[str]):
    """For the base model: when the run dir holds the history of a run from this base, that history's settings
    that define the weights and their digests (WEIGHT_FIELDS: the noise kind, the TP size, the dtype), as export
    and replay take them, so that the evaluation records the digests 04_replay rebuilds. An explicit --key=value
    that contradicts the history is refused; so is a task tier or level other than the run's (recorded_task)."""
    path = Path(cfg.run_dir) / HISTORY_FILE
    if not path.exists():
        return cfg
    history = read_history(path)
    if history["config"].get("model") != cfg.model:
        return cfg
    cfg = config_from_history(history, overrides, settings=dataclasses.asdict(cfg))
    return recorded_task(cfg, history["config"], overrides, str(path))


def exported_task(cfg, export_dir: str, overrides: list[str]):
    """An export's weights are evaluated on the tier and level of the task its run trained on: its manifest's
    copy of the history's config (recorded_task). A folder without a readable manifest is left to export.verify,
    which refuses it with its reason."""
    try:
        manifest = fileio.read_json(export.manifest_file(export_dir))
    except (OSError, stage.StageError):
        return cfg
    if not isinstance(manifest, dict) or not isinstance(manifest.get("config"), dict):
        return cfg
    return recorded_task(cfg, manifest["config"], overrides, str(export.manifest_file(export_dir)))


def recorded_task(cfg, recorded_config: dict, overrides: list[str], source: str):
    """cfg with the task tier and level (TASK_FIELDS) that a run recorded, when cfg evaluates that run's task (the
    same train_data; evaluating another task's sets, e.g. DAPO, keeps cfg's). An explicit --key=value that differs
    from the recorded value is refused, naming both: the trained weights would be scored on sets of another tier."""
    recorded = upgrade.recorded_settings(recorded_config)
    if recorded["train_data"] != cfg.train_data:
        return cfg
    _, explicit = cli.parse_overrides(overrides)
    refused = [f"--{k}={explicit[k]} (the run's is {k}={recorded[k]}, recorded in {source})" for k in TASK_FIELDS
               if k in explicit and explicit[k] != recorded[k]]
    if refused:
        raise stage.ConfigError("an evaluation of a run's weights is of the task tier and level the run trained "
                                f"on: {', '.join(refused)}; drop the setting or pass the recorded value")
    return dataclasses.replace(cfg, **{k: recorded[k] for k in TASK_FIELDS})


def data_paths(opts: dict, cfg) -> dict:
    """The sets to evaluate and their problems: on a task made here (train_data=learn, compute) the task's EVAL_SETS
    (TASK_SETS), else DATASETS, only those --sets names where it names some; each set's --name=PATH if given, else
    "smoke" (the smoke problems) with smoke_eval, else its own. A --name=PATH or a --sets name of a set the run does
    not evaluate is refused."""
    sets = TASK_SETS.get(cfg.train_data, DATASETS)
    chosen = [name.strip() for name in opts.get("sets", "").split(",") if name.strip()]
    stray = [f"--{name}=" for name in ALL_DATASETS if opts[name] and name not in sets]
    stray += [f"--sets={name}" for name in chosen if name not in sets]
    if stray:
        raise stage.ConfigError(f"{stray[0]} names a set this run does not evaluate (train_data={cfg.train_data}"
                                f" evaluates {', '.join(sets)})")
    return {name: opts[name] or ("smoke" if cfg.smoke_eval else sets[name])
            for name in sets if not chosen or name in chosen}


def eval_problems(path: str, cfg) -> list[dict]:
    problems = problems_from(path, cfg.run_seed, cfg.learn_digits, cfg.compute_level)
    return problems[:cfg.eval_problems] if cfg.eval_problems else problems


@contextlib.contextmanager
def open_checkpoint(cfg, export_dir: str, manifest: dict | None):
    """Read-only engines holding the export (its files verified against the manifest before; its loaded bits
    checked after loading) or, without an export, the base model."""
    if not export_dir:
        with EnginePool(cfg, models.resolve_model(cfg.model), perturbs=False) as engines:
            yield engines, {"kind": "base", "model": cfg.model, "per_rank_digests": engines.digests()}
        return
    with EnginePool(cfg, **export.load(export_dir, manifest), perturbs=False) as engines:
        loaded = export.check_loaded(engines, export_dir, manifest)  # the bits vLLM holds are the exported ones
        yield engines, {"kind": "export", "path": export_dir, "replayed_generations": manifest["replayed_generations"],
                        "manifest_sha256": fileio.sha256_file(export.manifest_file(export_dir)),
                        "per_rank_digests": loaded}


def claim_output_folder(out: Path, checkpoint: dict, cfg, data: dict, data_sha256: dict) -> None:
    """Finished episodes in `out` are reused on resume, so they must belong to this checkpoint, data (paths and
    sha256s) and settings; the settings that only say where files go or how fast the engine steps
    (EXECUTION_FIELDS), and how a perturbation is undone (RESTORE_FIELDS: an evaluation never perturbs), may differ;
    a setting newer than the folder's marker counts as what the code did before it (upgrade.recorded_settings), a
    marker without data sha256s (older: upgrade.EVALUATION_KEYS_ADDED) is compared by the paths alone, one without the
    reward definition without it, and an export by its manifest and digests (not by how its folder was named:
    runs/x/export and /abs/runs/x/export are one export)."""
    def settings(config: dict) -> dict:
        return {k: v for k, v in upgrade.recorded_settings(config).items()
                if k not in EXECUTION_FIELDS + RESTORE_FIELDS}

    def what(run: dict) -> dict:  # an export is its manifest and digests, wherever its folder was named from
        return dict(run, checkpoint={k: v for k, v in run["checkpoint"].items() if k != "path"})

    run = json.loads(json.dumps({"checkpoint": checkpoint, "config": settings(dataclasses.asdict(cfg)),
                                 "data": data, "data_sha256": data_sha256,
                                 "reward": common.reward_definition(cfg.fitness)}))
    marker = out / "eval_run.json"
    if marker.exists():
        recorded = upgrade.upgraded(fileio.read_json(marker), upgrade.EVALUATION_KEYS_ADDED)
        recorded = dict(recorded, config=settings(recorded.get("config", {})),
                        **{k: run[k] for k in upgrade.EVALUATION_KEYS_ADDED if recorded[k] is None})  # not compared
        diffs = field_differences(what(recorded), what(run), marker.name, "this evaluation")
        if diffs:
            raise stage.ConfigError(f"{out} holds an evaluation of another checkpoint or config ("
                                    + "; ".join(diffs) + "); choose another --out")
    fileio.write_json_atomic(run, marker)


def evaluate(engines, problems: list[dict], sample_indices, log: Path, name: str) -> list[dict]:
    """All (problem, sample) episodes. Each finished episode (with its transcript) is appended to `log` as it
    ends, those the scorer failed on once the set's episodes are within stage.SCORER_FAILURE_BOUND (else they are
    not done, and the stage stops); the ones already there are kept, not re-run."""
    finished = fileio.read_jsonl(log, required=EPISODE_RECORD_KEYS) if log.exists() else []
    done = {(r["problem_id"], r["sample_index"]): r for r in finished}
    todo = [(p, i) for p in problems for i in sample_indices if (p["id"], i) not in done]
    if done:
        print(f"[eval] {name}: resuming, {len(done)} episodes already finished, {len(todo)} to go")
    held = []  # episodes the scorer failed on

    def keep(record):
        if record["score_method"] in stage.SCORER_FAILURES:
            held.append(record)
        else:
            fileio.append_jsonl(log, [record])

    try:
        records = engines.run_agent(todo, desc=f"{name} episodes", on_record=keep)
    except (stage.EngineFailure, stage.Interrupted) as stop:
        finished = len(fileio.read_jsonl(log)) if log.exists() else 0
        print(f"[eval] {name}: stopped ({stop}); {log} keeps the {finished} finished episodes: run the same "
              "command again to resume")
        raise
    for record in records:
        done[(record["problem_id"], record["sample_index"])] = record
    records = [done[(p["id"], i)] for p in problems for i in sample_indices]
    stage.check_scorer_failures(records, name, f"the {len(held)} episodes it failed on are not done ({log} keeps the "
                                 "others; docs/scoring.md)")
    fileio.append_jsonl(log, held)
    return records


def strip_transcripts(records: list[dict], fitness_kind: str = "agent") -> list[dict]:
    """The eval16 files hold every record field but the conversation, and each episode's reward under the run's
    fitness (which the conversation may decide); transcripts stay in <name>_episodes.jsonl and the .md."""
    reward = common.EPISODE_REWARDS[fitness_kind]
    return [{**{k: v for k, v in r.items() if k != "messages"}, "reward": reward(r)} for r in records]


def format_metrics_table(metrics_by_dataset):
    """Aligned text table: one row per dataset, the reported group first, then the per-group Mean4 spread."""
    first = next(iter(metrics_by_dataset.values()), None)
    group_names = [g["group"] for g in first["groups"]] if first else []
    header = ["dataset", f"Mean4@{REPORTED_GROUP}", f"Pass4@{REPORTED_GROUP}", "mean@16", "pass@4 unbiased"]
    kind = first["reward"]["fitness"] if first else "agent"
    if kind != "agent":  # the agent score's mean reward is mean@16 itself
        header.append(f"{kind} reward@16")
    header += [f"Mean4 {name}" for name in group_names]
    rows = [header]
    for name, m in metrics_by_dataset.items():
        row = [name, m["reported"]["mean4"], m["reported"]["pass4"], m["mean_at_16"], m["pass_at_4_unbiased"]]
        if kind != "agent":
            row.append(m["reward"]["mean_at_16"])
        row += [g["mean4"] for g in m["groups"]]
        rows.append([row[0]] + [f"{x:.4f}" for x in row[1:]])
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths)))
             for r in rows]
    return "\n".join(line.rstrip() for line in lines)


def format_cut_replies(metrics_by_dataset) -> str:
    """One line per set: how many of its replies were cut at the token limit (metrics.cut_replies)."""
    lines = []
    for name, m in metrics_by_dataset.items():
        replies = m["replies"]
        unrecorded = (f" (not counted: {replies['unrecorded']} episodes recorded before their replies' finish "
                      "reasons were kept)" if replies["unrecorded"] else "")
        lines.append(f"[eval] {name}: {replies['cut']} of {replies['replies']} replies cut at the token limit"
                     f"{unrecorded}")
    return "\n".join(lines)


def _fenced(text):
    """A Markdown code block whose fence is longer than any backtick run inside the text."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}text\n{text}\n{fence}"


def write_transcripts_markdown(records, path):
    """A readable Markdown file with the full conversation of every failed (score 0) episode."""
    failed = [r for r in records if not r["score"]]
    parts = [f"# Failed episodes: {len(failed)} of {len(records)}\n"]
    for r in failed:
        parts.append(f"## {r['problem_id']} / sample {r['sample_index']}\n")
        parts.append(f"- score method: {r['score_method']}; finish: {r['finish_reason']}; turns: {r['turns']}; "
                     f"bash calls: {r['bash_calls']}; sandbox: {r['sandbox']}\n"
                     f"- prediction: `{r['prediction']}`; gold: `{r['gold']}`\n"
                     + (f"- error: {r['error']}\n" if r["error"] else ""))
        reasons = iter(upgrade.upgraded(r, upgrade.EPISODE_KEYS_ADDED)["reply_finish_reasons"] or [])
        for n, message in enumerate(r["messages"]):
            reason = next(reasons, None) if message["role"] == "assistant" else None
            heading = message["role"] + (f" (finish reason: {reason})" if reason else "")
            parts.append(f"### {n}. {heading}\n\n{_fenced(message['content'])}\n")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(parts))


if __name__ == "__main__":
    stage.run_stage(main, "eval")  # vLLM's log to <run_dir>/vllm.log; errors as one line; SIGTERM/SIGINT stop cleanly
