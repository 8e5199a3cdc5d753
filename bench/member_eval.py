"""The control a skeptic asks for: one random perturbation and no update, RandOpt's "keep the best". The member of
generation 0 with the highest fitness, theta_0 + sigma_0 * eps(seed), is evaluated as 03_eval.py evaluates a
checkpoint: the run's held-out sets (its task's, at its tier or level), 16 samples per problem with the same request
seeds. bench/compute_stages_summary.py then compares it with the base (or the trained model) as it compares the
trained one, so that an ES gain is shown to be more than one lucky draw.

    python bench/member_eval.py --run_dir=runs/compute --tensor_parallel_size=1 --gpu_memory_utilization=0.5
    python bench/compute_stages_summary.py --trained=runs/compute/eval-best-member --base=runs/compute/eval-base

Script options: out (default <run_dir>/eval-best-member), history (default <run_dir>/es_history.json). Every other
--key=value is a setting of where and how fast it runs (engines, memory, run_dir); the rest is the run's, from its
history (its task, tier or level, agent and sampling). Writes <set>_eval16.json, <set>_episodes.jsonl and
metrics.json, the checkpoint recorded as {"kind": "member", "generation": 0, "member", "seed", "sigma", "fitness"}.
"""

import dataclasses
import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import common  # noqa: E402
from agentic_es import cli, fileio, models, stage  # noqa: E402
from agentic_es.data import problems_sha256  # noqa: E402
from agentic_es.history import HISTORY_FILE, config_from_history, read_history  # noqa: E402
from agentic_es.metrics import EVAL_METRICS, EVAL_SAMPLES, REPORTED_GROUP, dataset_metrics  # noqa: E402
from agentic_es.pool import EnginePool  # noqa: E402

OPTIONS = {"out": "", "history": ""}
eval_stage = importlib.import_module("03_eval")  # its sets, their problems and its file format


def best_member(history: dict) -> dict:
    """Generation 0's member of the highest fitness (the first of equals): the perturbation of the base weights
    alone, before any update."""
    if not history["generations"]:
        raise stage.ConfigError("the history holds no generation: there is no member to evaluate")
    record = history["generations"][0]
    best = max(range(len(record["rewards"])), key=lambda i: record["rewards"][i])
    return {"kind": "member", "generation": 0, "member": best, "seed": record["seeds"][best],
            "sigma": record["sigma"], "fitness": record["rewards"][best]}


def main(argv: list[str]) -> dict:
    opts, overrides = cli.parse_args(argv, OPTIONS)
    cfg = cli.parse_config(overrides)
    history_path = Path(opts["history"] or Path(cfg.run_dir) / HISTORY_FILE)
    history = read_history(history_path)
    cfg = config_from_history(history, overrides)  # the run's own task, tier, agent and sampling
    member = best_member(history)
    out = Path(opts["out"] or Path(cfg.run_dir) / "eval-best-member")
    data = eval_stage.data_paths({name: "" for name in eval_stage.ALL_DATASETS}, cfg)
    datasets = {name: eval_stage.eval_problems(path, cfg) for name, path in data.items()}
    data_sha256 = {name: problems_sha256(path, cfg.run_seed, cfg.learn_digits, cfg.compute_level)
                   for name, path in data.items()}
    fileio.check_output_path(out, "out")
    common.check_sandbox(cfg, data=list(data.values()))
    stage.check_scorer()
    jobs = {name: [(p, i) for p in problems for i in range(EVAL_SAMPLES)] for name, problems in datasets.items()}
    print(f"[member] generation 0's best member (member {member['member']}, fitness {member['fitness']:.3f}, "
          f"sigma {member['sigma']:g}) on {', '.join(f'{n} ({len(j)} episodes)' for n, j in jobs.items())}")
    with EnginePool(cfg, models.resolve_model(cfg.model)) as engines:
        [(records, _)] = engines.map(common.evaluate_member,
                                     [(member["seed"], member["sigma"], [j for js in jobs.values() for j in js])],
                                     desc="best member", noun="member")
    stage.check_scorer_failures(records, "the best member's evaluation", "nothing is written")
    out.mkdir(parents=True, exist_ok=True)
    metrics = {"checkpoint": member, "samples": EVAL_SAMPLES, "reported_group": REPORTED_GROUP, "datasets": {}}
    for name, set_jobs in jobs.items():
        mine, records = records[:len(set_jobs)], records[len(set_jobs):]
        fileio.write_jsonl(mine, out / f"{name}_episodes.jsonl")
        fileio.write_json_atomic({"dataset": name, "data": data[name], "data_sha256": data_sha256[name],
                                  "checkpoint": member, "config": dataclasses.asdict(cfg),
                                  "reward": common.reward_definition(cfg.fitness),
                                  "records": eval_stage.strip_transcripts(mine, cfg.fitness)},
                                 out / f"{name}_eval16.json")
        metrics["datasets"][name] = dataset_metrics(mine, cfg.fitness)
    fileio.write_json_atomic(metrics, out / EVAL_METRICS)
    print(eval_stage.format_metrics_table(metrics["datasets"]))
    return metrics


if __name__ == "__main__":
    main(sys.argv[1:])
