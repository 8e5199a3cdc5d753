"""Does this ES learn? Train the real SmolLM2-135M-Instruct on the learn preset through 01_train's main (the real
loop: agent, the preset's shaped fitness, history), then evaluate the base model and the trained centre model
(rebuilt from the history, digests checked) on held-out additions never seen in training, of the tier it trained on
(--learn_digits), for several run seeds. The scorer is checked as the stages check it.

    python bench/learning.py --out=bench/results/learning_gpu.json --seeds=2   # the learn preset's constants
    python bench/learning.py --quick=true --out=/tmp/learning.json       # CPU sanity run (2 generations x 4 members)

Script options (defaults in OPTIONS): out, seeds (run seeds run_seed, run_seed+1, ...), heldout (problems),
eval_samples (episodes per held-out problem), run_root (one run folder per seed below it), quick, combine
(comma-separated reports of single seeds: one report of them all, nothing run). Every other --key=value is a Config
override: fitness (the preset's "shaped", or "agent"), population, generations, case_batch, alpha, sigma_start,
sigma_end, max_new_tokens, max_turns, concurrency, ...

Held-out metrics (bench/results JSON "metrics"): "reward", the primary one, is the shaped fitness's own scorer
(learn_task.shaped_reward: 1 correct final answer after a bash call, 0.5 a bash call that computed the question's own sum,
0.25 any bash call, 0.1 a right "a + b = n" in the text; the reports in bench/results used its earlier 0.5, any
stdout holding the sum); "accuracy" is the agent's unchanged score (scoring.py); "bash_call_rate"; "tool_sum_rate"
(episodes whose bash call computed the right sum, or better). 95% intervals: percentile
bootstrap over problems (episodes of one problem are not independent), for each mean and for the paired difference
trained - base (same problems, same request seeds). Writes the JSON report, each run's reward_curve.png (with the
held-out points) and held-out records. A run folder that also holds 03_eval.py's evaluations of the base and the
trained model (eval-base/, eval/: bench/learn_stages_h200.sh) has their held-out reward in the report beside.

Measured on 2x H200 (vLLM 0.26, learn preset: 12 generations x 16 members x 32 problems, 3 turns x 96 tokens):
first engine start ~110 s, later ones ~15-50 s; a generation 23-35 s (~20 episodes/s, ES ops 1 s of it);
held-out evaluation, base and trained, 128 problems x 8 samples: 125-150 s. Base model on those problems:
reward 0.048-0.049, accuracy 0.0, bash_call_rate 0.11.
"""

import dataclasses
import importlib
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import common  # noqa: E402
from agentic_es import cli, data, fileio, learn_task, models, settings, stage, stochastic_rounding, tracking  # noqa: E402
from agentic_es.stage import Interrupted, prepare_script  # noqa: E402
from agentic_es.history import rebuild_from_history  # noqa: E402
from agentic_es.metrics import EVAL_METRICS, EVAL_METRICS_SHAPE, EVAL_SAMPLES  # noqa: E402
from agentic_es.pool import EnginePool  # noqa: E402
from fitness_trend import seconds_of  # noqa: E402
from report import emit, print_until_reader_gone  # noqa: E402

# 8 samples per held-out problem: at 2, the paired difference's interval was +-0.018 around effects of +0.01 (GPU,
# 128 problems); the sampling noise within a problem shrinks with more samples, and evaluation is cheap next to training
OPTIONS = {"out": "", "seeds": 2, "heldout": 128, "eval_samples": 8, "run_root": "runs/learning", "quick": False,
           "combine": ""}
QUICK = ["--generations=2", "--population=4", "--case_batch=4"]  # plus heldout=16, eval_samples=1
BOOTSTRAP = 10_000
PRIMARY = "reward"  # the held-out metric the target is judged on (the others are reported beside it)
PAPER = {"alpha": 5e-4, "sigma_start": 1e-3, "sigma_end": 5e-4}  # the reference run's constants (common.Config)


def heldout_problems(n, learn_digits):
    """The first n of the held-out questions of the learn task's tier learn_digits (03_eval.py's set of a run on
    that tier): none shares its operands with a training question (either order)."""
    return learn_task.learn_problems(n, seed=learn_task.LEARN_HELDOUT_SEED, split="heldout", digits=learn_digits)


def evaluate_base_and_trained(cfg, history, problems, samples):
    """Held-out records of the base model, then of the centre model rebuilt from the history (on the run's engines,
    --engines, in input order)."""
    model_path = models.resolve_model(cfg.model)
    jobs = [(p, i) for p in problems for i in range(samples)]
    with EnginePool(cfg, model_path) as engine:
        t0 = time.perf_counter()
        base = engine.run_agent(jobs, desc="held-out, base model")
        seconds = time.perf_counter() - t0
        _, digests = rebuild_from_history(engine, cfg, model_path, history, history["generations"])
        trained = engine.run_agent(jobs, desc="held-out, trained model")
    return base, trained, digests, seconds


METRICS = {  # per-episode values compared on held-out problems; "reward" is the shaped fitness's scorer itself
    "reward": learn_task.shaped_reward,
    "accuracy": common.agent_reward,
    "bash_call_rate": lambda r: float(r["bash_calls"] > 0),
    "tool_sum_rate": lambda r: float(learn_task.shaped_reward(r) >= 0.5),
}


def per_problem_means(records, problems, metric):
    by_id = {}
    for r in records:
        by_id.setdefault(r["problem_id"], []).append(metric(r))
    return np.array([np.mean(by_id[p["id"]]) for p in problems])


def bootstrap_ci(values, rng):
    """Mean and 95% percentile-bootstrap interval of per-problem values (resampling problems)."""
    idx = rng.integers(0, len(values), size=(BOOTSTRAP, len(values)))
    means = values[idx].mean(axis=1)
    return float(values.mean()), float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


def compare(base_records, trained_records, problems, seed):
    """Base vs trained on each metric: means with 95% CIs and the paired difference (same problems and seeds)."""
    rng = np.random.default_rng(seed)
    result = {}
    for name, metric in METRICS.items():
        base = per_problem_means(base_records, problems, metric)
        trained = per_problem_means(trained_records, problems, metric)
        b, t, d = bootstrap_ci(base, rng), bootstrap_ci(trained, rng), bootstrap_ci(trained - base, rng)
        result[name] = {"base": dict(zip(("mean", "ci_low", "ci_high"), b)),
                        "trained": dict(zip(("mean", "ci_low", "ci_high"), t)),
                        "difference": dict(zip(("mean", "ci_low", "ci_high"), d)),
                        "trained_above_base_ci": t[0] > b[2], "difference_ci_above_zero": d[1] > 0}
    return result


def plot_with_heldout(history, path, heldout):
    """The run's reward curve with the centre model's held-out PRIMARY metric {updates applied: its mean and 95%
    interval} (0 updates: the base model)."""
    fig, ax = tracking.reward_curve_axes(history)
    updates = sorted(heldout)
    mean = [heldout[u]["mean"] for u in updates]
    err = [[heldout[u]["mean"] - heldout[u]["ci_low"] for u in updates],
           [heldout[u]["ci_high"] - heldout[u]["mean"] for u in updates]]
    ax.errorbar(updates, mean, yerr=err, fmt="s-", color="black", capsize=4,
                label=f"centre model, held-out {PRIMARY} (95% CI)")
    ax.set_xlabel("generation (held-out: after that many updates)")
    ax.legend(fontsize=8)
    tracking.save_figure(fig, path)


def update_change_fraction(model_path, alpha, population, sigma, seed=0, rounding="nearest"):
    """What fraction of the bf16 weights one ES step changes, measured on the model's own weights with fresh
    float32 noise, rounded once to bf16 as the worker does (to nearest, or stochastically). An update alpha/N * sum_i z_i eps_i has standard
    deviation alpha/sqrt(N) per element (z-scores with ddof=0 have sum z^2 = N); a perturbation has sigma."""
    from safetensors.torch import load_file

    g = torch.Generator().manual_seed(seed)
    changed = {"update": 0, "perturbation": 0}
    total = 0
    for name, w in sorted(load_file(str(Path(model_path) / "model.safetensors")).items()):
        w32 = w.float()
        for key, scale in (("update", alpha / population ** 0.5), ("perturbation", sigma)):
            moved = w32 + scale * torch.randn(w32.shape, generator=g)
            if rounding == "stochastic" and w.dtype == torch.bfloat16:
                moved, exact = torch.empty_like(w), moved
                stochastic_rounding.round_stochastic_(moved, exact, g)
            else:
                moved = moved.to(w.dtype)
            changed[key] += int((moved != w).sum())
        total += w.numel()
    return {k: v / total for k, v in changed.items()}


def combine_reports(paths: list[str]) -> dict:
    """One report of several single-seed reports of the same settings (seeds trained in separate processes, as
    bench/learning_paper_h200.sh runs them): their runs side by side, every_seed_beyond_ci over all of them."""
    reports = [fileio.read_json(Path(p)) for p in paths]
    settings = [{k: v for k, v in r["config"].items() if k not in ("run_seed", "run_dir")} for r in reports]
    differing = [p for p, s in zip(paths, settings) if s != settings[0]]
    if differing:
        raise stage.ConfigError(f"{', '.join(differing)}: other settings than {paths[0]}; only runs of one setting "
                                "combine")
    combined = {**reports[0], "combined_from": paths, "runs": [run for r in reports for run in r["runs"]]}
    combined["every_seed_beyond_ci"] = all(r[PRIMARY]["difference_ci_above_zero"] for r in combined["runs"])
    return combined


def main(argv):
    opts, overrides = cli.parse_args(argv, OPTIONS)
    if opts["combine"]:  # no training: the reports of seeds run apart, as one
        try:
            report = combine_reports(opts["combine"].split(","))
        except (OSError, ValueError, KeyError, stage.ConfigError, stage.StageError) as e:
            sys.exit(f"[learning] cannot combine {opts['combine']}: {type(e).__name__}: {e}")
        print(format_table(report["runs"]))
        return emit(report, opts["out"])
    if opts["quick"]:
        overrides = QUICK + overrides
        opts.update(heldout=min(opts["heldout"], 16), eval_samples=1)
    base_argv = ["--preset=learn", *overrides]
    base_cfg = cli.parse_config(base_argv)
    problems = heldout_problems(opts["heldout"], base_cfg.learn_digits)  # the tier it trains on (--learn_digits)
    stage.check_scorer()  # as the stages: a broken scorer would score every held-out answer 0
    train = importlib.import_module("01_train")
    report = {"bench": "learning", "date": time.strftime("%Y-%m-%d %H:%M"), "argv": argv,
              "config": dataclasses.asdict(base_cfg), "fitness": base_cfg.fitness, "heldout_problems": len(problems),
              "eval_samples": opts["eval_samples"],
              "primary_metric": PRIMARY, "metrics": {
                  "reward": "mean learn_task.shaped_reward (the shaped fitness's scorer) on held-out problems",
                  "accuracy": "mean agent score (a bash call, then a correct final answer)",
                  "bash_call_rate": "fraction of episodes with at least one bash call",
                  "tool_sum_rate": "fraction of episodes whose bash call computed the right sum (reward >= 0.5)"},
              "ci": f"95% percentile bootstrap over problems, {BOOTSTRAP} resamples", "runs": []}

    for run_seed in range(base_cfg.run_seed, base_cfg.run_seed + opts["seeds"]):
        run_dir = Path(opts["run_root"]) / f"seed-{run_seed}"
        argv_run = [*base_argv, f"--run_seed={run_seed}", f"--run_dir={run_dir}"]
        cfg = cli.parse_config(argv_run)
        t0 = time.perf_counter()
        history = train.main(argv_run)
        train_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        base, trained, digests, base_eval_s = evaluate_base_and_trained(cfg, history, problems, opts["eval_samples"])
        for model, records in (("base", base), ("trained", trained)):  # past the bound the 0s are the scorer's
            stage.check_scorer_failures(records, f"seed {run_seed}, held-out {model} model",
                                         "no report is written (docs/scoring.md)")
        eval_s = time.perf_counter() - t0
        result = compare(base, trained, problems, run_seed)
        gens = history["generations"]
        primary = result[PRIMARY]
        plot_with_heldout(history, run_dir / train.REWARD_CURVE, {0: primary["base"], len(gens): primary["trained"]})
        fileio.write_json_atomic({"problems": problems, "base": train_records(base), "trained": train_records(trained)},
                                 run_dir / "heldout_eval.json")
        episodes = sum(len(g["rewards"]) for g in gens) * cfg.case_batch
        generation_s = training_seconds(history)
        report["runs"].append({
            "run_seed": run_seed, "run_dir": str(run_dir), **result,
            "replay_digests_equal_training": digests == gens[-1]["digests"],
            "weights_moved": gens[-1]["digests"] != history["base_digests"],
            "mean_fitness_per_generation": [float(np.mean(g["rewards"])) for g in gens],
            "max_fitness_per_generation": [float(np.max(g["rewards"])) for g in gens],
            "train_seconds_this_call": round(train_s, 1), "train_generation_seconds": round(generation_s, 1),
            "eval_seconds": round(eval_s, 1),
            "train_episodes": episodes, "train_episodes_per_s": round(episodes / generation_s, 2),
            "eval_episodes_per_s": round(len(base) / base_eval_s, 2),
            "device_type": history["device_type"], "vllm_version": history["vllm_version"],
            "stages_eval": stages_eval(run_dir, history),
        })
        print(format_table(report["runs"]), flush=True)

    model_path = models.resolve_model(base_cfg.model)
    report["bf16_change_fraction"] = {
        "this_run": dict(alpha=base_cfg.alpha, sigma=base_cfg.sigma_start, population=base_cfg.population,
                         rounding=base_cfg.rounding, **update_change_fraction(
                             model_path, base_cfg.alpha, base_cfg.population, base_cfg.sigma_start,
                             rounding=base_cfg.rounding)),
        **{f"paper_constants_{mode}": dict(alpha=PAPER["alpha"], sigma=PAPER["sigma_start"],
                                           population=base_cfg.population, rounding=mode, **update_change_fraction(
                                               model_path, PAPER["alpha"], base_cfg.population, PAPER["sigma_start"],
                                               rounding=mode))
           for mode in settings.ROUNDING_MODES},
    }
    report["every_seed_beyond_ci"] = all(r[PRIMARY]["difference_ci_above_zero"] for r in report["runs"])
    print(format_table(report["runs"]))
    return emit(report, opts["out"])


def stages_eval(run_dir: Path, history: dict) -> dict | None:
    """03_eval.py's held-out reward of the base and the trained model of this run, when its folder holds both
    evaluations (eval-base/ and eval/ of the learn task's held-out set, as bench/learn_stages_h200.sh makes them):
    its first eval_problems held-out questions x 16 samples, each episode's reward under the run's fitness; else
    None. same_weights: the evaluated checkpoints' digests are the history's base and trained ones."""
    paths = {"base": run_dir / "eval-base" / EVAL_METRICS, "trained": run_dir / "eval" / EVAL_METRICS}
    if not all(p.exists() for p in paths.values()):
        return None
    metrics = {k: fileio.read_json(p, required=EVAL_METRICS_SHAPE) for k, p in paths.items()}
    if any("learn_heldout" not in m["datasets"] for m in metrics.values()):
        return None
    sets = {k: m["datasets"]["learn_heldout"] for k, m in metrics.items()}
    digests = {k: m["checkpoint"]["per_rank_digests"] for k, m in metrics.items()}
    final = history["generations"][-1]["digests"] if history["generations"] else history["base_digests"]
    return {"fitness": sets["trained"]["reward"]["fitness"], "problems": sets["trained"]["n_problems"],
            "samples": EVAL_SAMPLES,
            **{k: {"reward": d["reward"]["mean_at_16"], "accuracy": d["mean_at_16"], "mean4": d["reported"]["mean4"],
                   "pass4": d["reported"]["pass4"]} for k, d in sets.items()},
            "same_weights": digests == {"base": history["base_digests"], "trained": final}}


def training_seconds(history):
    """Seconds the history's generations took (members, update, digest; engine starts excluded), from the timings
    each generation recorded: the same whether the run was trained in one call or resumed across several."""
    return sum(seconds_of(g) for g in history["generations"])


def train_records(records):
    return [{k: v for k, v in r.items() if k != "messages"} for r in records]


def format_table(runs):
    lines = [f"{'seed':>10}  {'metric':<15} {'base [95% CI]':>22}  {'trained [95% CI]':>22}  {'diff [95% CI]':>24}  beyond CI"]
    for r in runs:
        for name in METRICS:
            b, t, d = r[name]["base"], r[name]["trained"], r[name]["difference"]
            lines.append(f"{r['run_seed']:>10}  {name:<15} {b['mean']:.3f} [{b['ci_low']:.3f}, {b['ci_high']:.3f}]    "
                         f"{t['mean']:.3f} [{t['ci_low']:.3f}, {t['ci_high']:.3f}]    "
                         f"{d['mean']:+.3f} [{d['ci_low']:+.3f}, {d['ci_high']:+.3f}]    "
                         f"{r[name]['difference_ci_above_zero']}")
        stages = r.get("stages_eval")
        if stages:
            lines.append(f"{r['run_seed']:>10}  03_eval.py, {stages['fitness']} reward of {stages['problems']} "
                         f"held-out problems x {stages['samples']} samples: {stages['base']['reward']:.3f} -> "
                         f"{stages['trained']['reward']:.3f} (accuracy {stages['base']['accuracy']:.3f} -> "
                         f"{stages['trained']['accuracy']:.3f}; the run's weights: {stages['same_weights']})")
    return "\n".join(lines)


if __name__ == "__main__":
    print_until_reader_gone()
    prepare_script()  # SIGINT/SIGTERM stop training between generations' writes; a later call resumes the history
    try:
        main(sys.argv[1:])
    except Interrupted as stop:
        sys.exit(stop.exit_status)
