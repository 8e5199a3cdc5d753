"""Stage 4: the aligned four-sample replay, a reproduction artifact.

Rebuilds theta in memory from the base model and the history (no export needed): as many generations as the
evaluated checkpoint had, and the rebuilt per-rank digests must equal the ones the evaluation recorded (and an
export's manifest, when one is given). Then it re-runs exactly the reported group's requests: the same problem ids,
sample indices 12-15 and seeds as the original evaluation, on the same data (its sha256). It writes the replayed
scores beside the original ones with per-problem agreement, into a new file; the eval16 files are only read.

    python 04_replay.py                      # <run_dir>/es_history.json against <run_dir>/eval
    python 04_replay.py --preset=smoke       # the smoke run
    python 04_replay.py --preset=learn       # the learn run: samples 12-15 of its held-out additions, with rewards
    python 04_replay.py --preset=compute     # the compute run: samples 12-15 of both its held-out sets
"""

from pathlib import Path

import common
from agentic_es import checkpoint_noise, cli, data, export, fileio, models, stage, upgrade
from agentic_es.history import (HISTORY_FILE, REBUILD_FIELDS, check_base_files, config_from_history,
                                field_differences, read_history, rebuild_from_history)
from agentic_es.metrics import (EVAL16_SHAPE, EVAL_METRICS, EVAL_METRICS_SHAPE, REPORTED_SAMPLES, group_label,
                                mean4_pass4)
from agentic_es.pool import EnginePool

HISTORY = ""  # default: <run_dir>/es_history.json
EXPORT = ""  # optionally an export folder whose manifest must match the rebuilt digests too
EVAL = ""  # default: <run_dir>/eval, holding <name>_eval16.json of 03_eval.py (read only)
OUT = ""  # default: <EVAL>/aligned_history_replay_eval4.json
GROUP = list(REPORTED_SAMPLES)  # the reported group, sample indices 12-15


def main(argv: list[str]) -> dict:
    options = {"history": HISTORY, "export": EXPORT, "eval": EVAL, "out": OUT}
    cli.exit_if_help(argv, __doc__, __file__, options, settings=REBUILD_FIELDS)  # the others: the run's
    opts, overrides = cli.parse_args(argv, options)
    run_dir = Path(cli.parse_config(overrides).run_dir)
    history_path = Path(opts["history"] or run_dir / HISTORY_FILE)
    eval_dir = Path(opts["eval"] or run_dir / "eval")
    out = Path(opts["out"] or eval_dir / "aligned_history_replay_eval4.json")
    export_dir = opts["export"]

    history = read_history(history_path)
    originals = {name: upgrade.upgraded(fileio.read_json(eval_dir / f"{name}_eval16.json", required=EVAL16_SHAPE),
                                        upgrade.EVALUATION_KEYS_ADDED)
                 for name in evaluated_sets(eval_dir)}
    cfg = replay_config(history, originals, overrides)
    checkpoint = next(iter(originals.values()))["checkpoint"]  # what was evaluated: the base, or an export of K generations
    check_digest_kind(checkpoint, cfg, eval_dir)  # before the engine starts: digests of another kind never match
    check_reward_definition(originals, cfg, eval_dir)  # its scores and rewards compare only under the same one
    generations = history["generations"][: checkpoint.get("replayed_generations", 0)]
    expected = {"the evaluated checkpoint": checkpoint["per_rank_digests"]}
    if export_dir:
        expected[export_dir] = export.digests(export.verify(export_dir, cfg.tensor_parallel_size))
    jobs = {name: aligned_jobs(original, cfg) for name, original in originals.items()}
    check_data_unchanged(originals, eval_dir, cfg)
    transcripts = {name: original_transcripts(eval_dir / f"{name}_episodes.jsonl") for name in originals}

    model_path = models.resolve_model(cfg.model)  # a hub id must be in the local cache: refused before any engine
    check_base_files(history, model_path)  # another base is refused before the engine starts
    fileio.check_output_path(out, "out", folder=False)
    fileio.check_output_path(cfg.run_dir, "run_dir")  # vLLM's log goes there
    # the replay runs model-written commands again: the same start-up sandbox check as the evaluation
    common.check_sandbox(cfg, data=[o["data"] for o in originals.values()], checkpoint=export_dir or None)
    stage.check_scorer()  # a scorer that cannot start or scores known answers wrongly is refused before vLLM starts
    with EnginePool(cfg, model_path, perturbs=False) as engines:
        _, digests = rebuild_from_history(engines, cfg, model_path, history, generations, compare_config=False,
                                          desc=f"rebuilding theta from {len(generations)} generations")
        for source, wanted in expected.items():
            if digests != wanted:
                raise stage.ExportError(f"rebuilt per-rank digests {digests} differ from {source}'s {wanted}")
        replayed = {name: engines.run_agent(job, desc=f"{name} replay") for name, job in jobs.items()}
    for name, records in replayed.items():  # a broken scorer's 0s would read as disagreements
        stage.check_scorer_failures(records, f"{name} replay", f"{out} is not written (docs/scoring.md)")

    report = {
        "group": group_label(GROUP), "history": str(history_path),
        "history_sha256": fileio.sha256_file(history_path), "replayed_generations": len(generations),
        "per_rank_digests": digests, "export": export_dir or None,
        "datasets": {name: compare(originals[name], replayed[name], transcripts[name], cfg.fitness)
                     for name in originals},
    }
    fileio.write_json_atomic(report, out)
    print_report(report, out)
    return report


def evaluated_sets(eval_dir: Path) -> list[str]:
    """The sets 03_eval.py evaluated, named in its metrics file (written last: only a finished evaluation)."""
    metrics = eval_dir / EVAL_METRICS
    if not metrics.exists():
        raise stage.ConfigError(f"{metrics} not found: 04_replay.py replays a finished 03_eval.py (--eval=FOLDER)")
    return list(fileio.read_json(metrics, required=EVAL_METRICS_SHAPE)["datasets"])


def replay_config(history: dict, originals: dict, overrides: list[str]) -> common.Config:
    """What defines the weights (base model, TP size, dtype, noise) from the history; the sampling and agent
    settings from the original evaluation, so that the same requests meet the same weights."""
    (first_set, first), *others = originals.items()
    diffs = [d for name, o in others for d in field_differences(
        {"config": first["config"], "checkpoint": first["checkpoint"]},
        {"config": o["config"], "checkpoint": o["checkpoint"]}, first_set, name)]
    if diffs:
        raise stage.ConfigError("the eval16 files come from different checkpoints or settings (" + "; ".join(diffs)
                                + "); they cannot be replayed together")
    return config_from_history(history, overrides, settings=first["config"])


def digest_kind(digests: list[str]) -> str:
    """What recorded digests are digests of: "noise=checkpoint" (one "ckpt:" digest of the state in checkpoint
    terms, checkpoint_noise.combine_checkpoint_digest, the same at every TP size), or rank-salted ones (a sha256
    per TP rank)."""
    if len(digests) == 1 and digests[0].startswith("ckpt:"):
        return "noise=checkpoint"
    return f"noise=rank_salted at tensor_parallel_size={len(digests)}"


def check_digest_kind(checkpoint: dict, cfg: common.Config, eval_dir: Path) -> None:
    """The evaluation recorded its checkpoint's digests in the terms of the noise (and TP size) it ran with; the
    replay rebuilds them in the history's. Where those differ no rebuild can match: say what to run instead."""
    recorded = digest_kind(checkpoint["per_rank_digests"])
    rebuilt = ("noise=checkpoint" if common.is_checkpoint_noise(cfg)
               else f"noise=rank_salted at tensor_parallel_size={cfg.tensor_parallel_size}")
    if recorded == rebuilt:
        return
    problem = (f"{eval_dir} holds its checkpoint's digests for {recorded}, and this history rebuilds them for "
               f"{rebuilt}: they cannot match. ")
    if checkpoint["kind"] != "base":
        raise stage.ConfigError(problem + "The evaluated export was not made from this history")
    settings = f"--noise={cfg.noise}" + ("" if common.is_checkpoint_noise(cfg)
                                        else f" --tensor_parallel_size={cfg.tensor_parallel_size}")
    raise stage.ConfigError(problem + f"Evaluate the base model again with the run's settings into a new folder "
                            f"(python 03_eval.py --export= {settings} --out=FOLDER) and replay that one "
                            "(--eval=FOLDER)")


def check_reward_definition(originals: dict, cfg: common.Config, eval_dir: Path) -> None:
    """The replay scores its episodes under this code's reward definition (common.reward_definition): compared with
    scores and rewards of another, the agreement would measure the scorer, not the weights. Refused where an eval16
    file recorded another, naming both values. One written before eval16 files recorded it: on the agent's score
    compared under this code's scorer, saying so; on the shaped reward refused (its rules changed at 097270a, and
    which ones scored it the file cannot tell)."""
    current = common.reward_definition(cfg.fitness)
    for name, original in originals.items():
        path = eval_dir / f"{name}_eval16.json"
        recorded = original["reward"]
        if recorded is None and cfg.fitness == "shaped":
            raise stage.ConfigError(f"{path} records no reward definition (written before they were recorded), and "
                                    "the shaped reward's rules changed at 097270a: which ones scored it the file "
                                    f"cannot tell; this code's are {current!r}. Replay it with the code that "
                                    "evaluated it")
        if recorded is None:
            print(f"[replay] {path} records no reward definition (written before they were recorded): its scores are "
                  f"compared with this code's ({current['agent_score']})")
        elif differences := common.reward_differences(recorded, current, "the evaluation", "this code"):
            raise stage.ConfigError(f"{path} was scored under another reward definition: " + "; ".join(differences)
                                    + ". Replay it with the code that evaluated it")


def aligned_jobs(original: dict, cfg: common.Config) -> list[tuple[dict, int]]:
    """The reported group's (problem, sample_index) requests of one eval16 file, problems as evaluated (cfg: the
    evaluation's settings, replay_config)."""
    problems = {p["id"]: p for p in data.problems_from(original["data"], cfg.run_seed, cfg.learn_digits,
                                                         cfg.compute_level)}
    ids = list(dict.fromkeys(r["problem_id"] for r in original["records"]))
    missing = [pid for pid in ids if pid not in problems]
    if missing:
        raise stage.DataError(f"{original['data']} no longer holds evaluated problems {missing[:5]}")
    recorded = {(r["problem_id"], r["sample_index"]) for r in original["records"]}
    unrecorded = [(pid, i) for pid in ids for i in GROUP if (pid, i) not in recorded]
    if unrecorded:  # the comparison needs every original sample of the group: refused before the engine starts
        raise stage.DataError(f"the evaluation of {original['data']} has no records of (problem, sample) "
                              f"{unrecorded[:5]} ({len(unrecorded)} in all)")
    return [(problems[pid], i) for pid in ids for i in GROUP]


def check_data_unchanged(originals: dict, eval_dir: Path, cfg) -> None:
    """Each set's data must be what the evaluation used: its sha256 against the one its eval16 file recorded. An
    eval16 file written before they recorded it holds the path only: the data is then taken by its path, as
    before (aligned_jobs still finds every evaluated problem id in it)."""
    for name, original in originals.items():
        path, then = original["data"], original["data_sha256"]
        if then is None:
            print(f"[replay] {eval_dir / f'{name}_eval16.json'} records its data by path only (written before data "
                  f"sha256s): {path} is taken by its path")
        elif (now := data.problems_sha256(path, cfg.run_seed, cfg.learn_digits, cfg.compute_level)) != then:
            raise stage.DataError(f"{path}: sha256 {now} differs from the {then} that "
                                  f"{eval_dir / f'{name}_eval16.json'} recorded: the data changed since the "
                                  "evaluation; replay with the data it evaluated")


def original_transcripts(log: Path) -> dict:
    """The original episodes' conversations (03_eval's <name>_episodes.jsonl), when that log is at hand."""
    if not log.exists():
        return {}
    rows = fileio.read_jsonl(log, required=("problem_id", "sample_index", "messages"))
    return {(r["problem_id"], r["sample_index"]): r["messages"] for r in rows}


def compare(original: dict, replayed: list[dict], transcripts: dict, fitness_kind: str = "agent") -> dict:
    """Per problem: the original and replayed scores of samples 12-15, whether each sample's score agrees, and
    whether its whole conversation came out identical (when the original transcripts are available); the group's
    mean reward under the evaluation's fitness, original (None from an evaluation that recorded no rewards) and
    replayed."""
    before = {(r["problem_id"], r["sample_index"]): r for r in original["records"]}
    rows = []
    for pid in dict.fromkeys(r["problem_id"] for r in replayed):
        new = {r["sample_index"]: r for r in replayed if r["problem_id"] == pid}
        old = [before[(pid, i)] for i in GROUP]
        if [o["seed"] for o in old] != [new[i]["seed"] for i in GROUP]:
            raise stage.DataError(f"problem {pid}: replay seeds differ from the original evaluation's")
        rows.append({"problem_id": pid, "sample_indices": GROUP, "seeds": [o["seed"] for o in old],
                     "original_scores": [o["score"] for o in old], "replayed_scores": [new[i]["score"] for i in GROUP],
                     "agree": [o["score"] == new[i]["score"] for o, i in zip(old, GROUP)],
                     "same_transcript": [transcripts.get((pid, i)) == new[i]["messages"] if transcripts else None
                                         for i in GROUP]})
    orig_mean4, orig_pass4 = mean4_pass4([r["original_scores"] for r in rows])
    new_mean4, new_pass4 = mean4_pass4([r["replayed_scores"] for r in rows])
    agree = [a for r in rows for a in r["agree"]]
    same = [t for r in rows for t in r["same_transcript"]]
    group = [before[(r["problem_id"], i)] for r in rows for i in GROUP]
    orig_reward = (sum(o["reward"] for o in group) / len(group)) if all("reward" in o for o in group) else None
    return {"original": {"mean4": orig_mean4, "pass4": orig_pass4, "reward": orig_reward},
            "replayed": {"mean4": new_mean4, "pass4": new_pass4, "reward": common.fitness(replayed, fitness_kind)},
            "fitness": fitness_kind,
            "sample_agreement": sum(agree) / len(agree),
            "identical_transcripts": sum(same) / len(same) if transcripts else None,
            "problems_fully_agreeing": sum(all(r["agree"]) for r in rows), "problems": rows}


def print_report(report: dict, out: Path) -> None:
    print(f"[replay] group {report['group']} after {report['replayed_generations']} generations")
    print(f"{'dataset':<10} {'Mean4 orig':>10} {'Mean4 replay':>12} {'Pass4 orig':>10} {'Pass4 replay':>12} "
          f"{'agreement':>9} {'same transcript':>15} {'reward orig':>11} {'reward replay':>13}")
    for name, d in report["datasets"].items():
        same = "n/a" if d["identical_transcripts"] is None else f"{d['identical_transcripts']:.3f}"
        original = "n/a" if d["original"]["reward"] is None else f"{d['original']['reward']:.3f}"
        print(f"{name:<10} {d['original']['mean4']:>10.3f} {d['replayed']['mean4']:>12.3f} "
              f"{d['original']['pass4']:>10.3f} {d['replayed']['pass4']:>12.3f} {d['sample_agreement']:>9.3f} "
              f"{same:>15} {original:>11} {d['replayed']['reward']:>13.3f}")
    print(f"[replay] wrote {out}")


if __name__ == "__main__":
    # vLLM's log to <run_dir>/vllm.log; errors as one line; SIGTERM/SIGINT stop cleanly
    stage.run_stage(main, "replay")
