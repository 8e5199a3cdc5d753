"""bench/learning.py's statistics and reports: the bootstrap comparison of base and trained, training time taken
from the history (so that a run resumed across several calls reports its whole training), 03_eval.py's held-out
reward of the same run beside its own; the fitness trend, the reward curves and the detached GPU runs."""

import importlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import common
from agentic_es import data, fileio, learn_task, metrics, stage, tracking

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))
import fitness_trend  # noqa: E402
import learning  # noqa: E402

PROBLEM = learn_task.learn_problems(1, seed=7)[0]
GOLD = PROBLEM["answer"]


def test_compare_finds_a_shift_beyond_the_interval_and_none_between_equal_models():
    problems = [{"id": f"p{i}"} for i in range(64)]
    rng = np.random.default_rng(0)

    def records(p_bash):
        messages = [{"role": "system", "content": ""}, {"role": "user", "content": PROBLEM["question"]}]
        return [{"problem_id": p["id"], "score": 0.0, "bash_calls": int(rng.random() < p_bash), "gold": GOLD,
                 "messages": messages} for p in problems for _ in range(8)]

    result = learning.compare(records(0.0), records(0.5), problems, seed=1)
    shifted = result["bash_call_rate"]
    assert shifted["difference_ci_above_zero"] and shifted["trained_above_base_ci"]
    assert 0.4 < shifted["difference"]["mean"] < 0.6
    reward = result["reward"]  # 0.25 a bash call
    assert reward["difference_ci_above_zero"] and 0.1 < reward["difference"]["mean"] < 0.15
    same = records(0.2)
    equal = learning.compare(same, same, problems, seed=1)["bash_call_rate"]
    assert equal["difference"] == {"mean": 0.0, "ci_low": 0.0, "ci_high": 0.0}
    assert not equal["difference_ci_above_zero"]


def test_training_seconds_add_up_every_generation_of_the_history():
    history = {"generations": [
        {"timings": {"members": 20.0, "update": 0.5, "digest": 0.25, "perturb": 9.0, "rollout": 9.0}},
        {"timings": {"members": 30.0, "update": 0.5}},  # a history written before digests were timed
    ]}
    assert learning.training_seconds(history) == 51.25  # perturb/rollout are inside members: not counted twice


def trend_history(means, alpha=5e-4, sigmas=None, members=16, seed=0):
    """A history whose generation g has mean member fitness means[g] (member rewards spread around it)."""
    rng = np.random.default_rng(seed)
    sigmas = sigmas or [1e-3] * len(means)
    gens = []
    for m, s in zip(means, sigmas):
        spread = rng.normal(0, 0.02, members)
        gens.append({"rewards": list(m + spread - spread.mean()), "alpha": alpha, "sigma": s})
    return {"generations": gens}


def test_fitness_trend_recovers_a_known_slope_and_finds_none_in_noise():
    rng = np.random.default_rng(1)
    g = np.arange(60)
    rising = fitness_trend.fitness_trend(trend_history(0.05 + 3e-4 * g + rng.normal(0, 0.01, 60)))
    assert rising["ci_low"] < 3e-4 < rising["ci_high"] and rising["ci_low"] > 0
    assert abs(rising["slope_per_generation"] - 3e-4) < 1.5e-4
    flat = fitness_trend.fitness_trend(trend_history(0.05 + rng.normal(0, 0.01, 60)))
    assert flat["ci_low"] < 0 < flat["ci_high"]
    assert flat["within_generation_std"] == pytest.approx(np.mean([np.std(x["rewards"]) for x in
                                                                   trend_history([0.05] * 60)["generations"]]))
    shaped = fitness_trend.fitness_trend(trend_history([0.1] * 4, alpha=4e-3, sigmas=[2e-3, 2e-3, 1e-3, 1e-3]))
    assert shaped["alpha_x_sigma"] == pytest.approx(4e-3 * 1.5e-3) and shaped["slope_per_generation"] == pytest.approx(0)


def test_generations_to_match_a_reference_gain_is_its_gain_over_the_run_slope_and_open_when_the_run_is_flat():
    rng = np.random.default_rng(2)
    reference = trend_history(0.05 + 3e-3 * np.arange(12) + rng.normal(0, 0.002, 12))  # gains ~0.036 over 12
    slow = trend_history(0.05 + 3e-4 * np.arange(60) + rng.normal(0, 0.002, 60))  # at 3e-4: ~120 generations
    match = fitness_trend.generations_to_match(slow, fitness_trend.reference_gain([reference, reference]))
    gain = fitness_trend.fitness_trend(reference)["slope_per_generation"] * 12
    assert match["reference_gain"] == pytest.approx(gain)
    assert match["match_generations"] == pytest.approx(gain / fitness_trend.fitness_trend(slow)["slope_per_generation"])
    assert match["match_ci_low"] < 120 < match["match_ci_high"] and 100 < match["match_generations"] < 140
    flat = fitness_trend.generations_to_match(trend_history(0.05 + rng.normal(0, 0.01, 60)),
                                               fitness_trend.reference_gain([reference]))
    assert flat["match_ci_high"] is None  # a slope interval reaching 0: no generations suffice for sure
    with pytest.raises(ValueError, match="gained no training fitness"):
        fitness_trend.reference_gain([trend_history(0.08 - 3e-3 * np.arange(12))])


def test_generation_seconds_are_the_members_update_and_digest_of_the_timed_generations():
    gens = [{"generation": g, "timings": {"perturb": 1.0, "rollout": 5.0, "restore": 0.5, "members": 6.5 + g,
                                          "update": 2.0, "digest": 0.5}} for g in range(4)]
    timed = fitness_trend.generation_seconds({"generations": gens}, timed_from=1)
    assert timed["timed_generations"] == 3 and timed["seconds_per_generation"] == 11.0  # 6.5 + 2 + 2.0 + 0.5
    assert (timed["seconds_min"], timed["seconds_max"], timed["es_ops_seconds"]) == (10.0, 12.0, 3.5)
    assert fitness_trend.generation_seconds({"generations": gens}, timed_from=9) == {"timed_generations": 0}


def test_single_seed_reports_combine_into_one_with_every_seed_judged(tmp_path):
    def seed_report(seed, beyond, **config):
        path = tmp_path / f"seed{seed}.json"
        fileio.write_json_atomic({"config": {"run_seed": seed, "run_dir": f"/r/{seed}", "alpha": 5e-4, **config},
                                  "runs": [{"run_seed": seed, "reward": {"difference_ci_above_zero": beyond}}]}, path)
        return str(path)

    both = learning.combine_reports([seed_report(1, True), seed_report(2, True)])
    assert [r["run_seed"] for r in both["runs"]] == [1, 2] and both["every_seed_beyond_ci"] is True
    assert learning.combine_reports([seed_report(1, True), seed_report(2, False)])["every_seed_beyond_ci"] is False
    with pytest.raises(stage.ConfigError, match="only runs of one setting combine"):
        learning.combine_reports([seed_report(1, True), seed_report(3, True, alpha=4e-3)])


def test_fitness_trend_refuses_a_history_too_short_for_a_slope():
    with pytest.raises(ValueError, match="at least 3 generations"):
        fitness_trend.fitness_trend(trend_history([0.05, 0.06]))


def test_a_bench_whose_reader_has_gone_runs_to_its_end_and_writes_its_report(tmp_path):
    """A bench piped into a reader that has gone (head) still writes its --out file, without a traceback."""
    history = tmp_path / "es_history.json"
    history.write_text(json.dumps(trend_history([0.05 + 1e-3 * g for g in range(20)])))
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first line: every print meets a closed pipe
    try:
        done = subprocess.run([sys.executable, str(BENCH / "fitness_trend.py"), str(history),
                               f"--out={tmp_path / 'trend.json'}"], stdout=write_end, stderr=subprocess.PIPE,
                              text=True, timeout=120)
    finally:
        os.close(write_end)
    assert done.returncode == 0 and "Error" not in done.stderr, done.stderr
    report = json.loads((tmp_path / "trend.json").read_text())
    assert report["runs"][0]["slope_per_generation"] == pytest.approx(1e-3, abs=2e-4)


def reward_history(rewards):
    config = {"population": len(rewards[0]), "alpha": 4e-3, "sigma_start": 2e-3, "sigma_end": 1e-3, "run_seed": 3}
    return {"base_model": "tiny", "config": config,
            "generations": [{"generation": g, "rewards": r} for g, r in enumerate(rewards)]}


def test_the_reward_curve_plots_each_generation_and_replaces_its_file_whole(tmp_path):
    history = reward_history([[0.1, 0.3], [0.2, 0.6], [0.4, 0.4]])
    fig, ax = tracking.reward_curve_axes(history)
    mean, best = ax.get_lines()[:2]
    assert list(mean.get_ydata()) == pytest.approx([0.2, 0.4, 0.4]) and list(best.get_ydata()) == [0.3, 0.6, 0.4]
    path = tmp_path / "reward_curve.png"
    path.write_bytes(b"an older picture")
    assert tracking.plot_reward_curve(history, path) == path
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and [p.name for p in tmp_path.iterdir()] == [path.name]


def test_the_learning_curve_adds_the_heldout_metric_with_its_interval(tmp_path, monkeypatch):
    saved = []
    monkeypatch.setattr(tracking, "save_figure", lambda fig, path: saved.append(fig))
    heldout = {0: {"mean": 0.2, "ci_low": 0.1, "ci_high": 0.25}, 2: {"mean": 0.5, "ci_low": 0.45, "ci_high": 0.7}}
    learning.plot_with_heldout(reward_history([[0.1, 0.3], [0.2, 0.6], [0.4, 0.4]]), tmp_path / "c.png", heldout)
    (fig,) = saved
    bars = [c for c in fig.axes[0].containers if c.has_yerr]
    (line,) = [b.lines[0] for b in bars]
    assert list(line.get_xdata()) == [0, 2] and list(line.get_ydata()) == [0.2, 0.5]
    (segments,) = [b.lines[2][0].get_segments() for b in bars]
    assert [(s[0][1], s[1][1]) for s in segments] == [pytest.approx((0.1, 0.25)), pytest.approx((0.45, 0.7))]


STAND_IN_LEARNING = """#!/usr/bin/env bash
# stands in for `python bench/learning.py ...`: one generation every 0.2 s into RUN_ROOT/seed-S/es_history.json
for a in "$@"; do case $a in --run_root=*) root=${a#*=};; --run_seed=*) seed=${a#*=};; esac; done
history=$root/seed-$seed/es_history.json; mkdir -p "$(dirname "$history")"
echo "vLLM of seed $seed" >> "$root/seed-$seed/vllm.log"
n=0; [ -f "$history" ] && n=$(sed 's/[^0-9]//g' "$history")
trap 'echo "[train] generation $n abandoned"; exit 130' INT
while true; do
  sleep 0.2; n=$((n + 1)); echo "{\\"generations\\": $n}" > "$history.tmp"; mv "$history.tmp" "$history"
  echo "[train] generation $n/200"
done
"""


def test_the_detached_paper_runs_outlive_start_and_collect_keeps_their_histories(tmp_path):
    """bench/learning_paper_detached.sh around bench/learning_paper_h200.sh with a stand-in for learning.py: `start`
    returns while both seeds train (resumed from RESUME), `collect` copies their current histories (all along its wait,
    so a call cut at its limit keeps them), `collect ... stop` stops them and copies the last ones, and a collect
    where nothing runs says so at once."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python").write_text(STAND_IN_LEARNING)
    (fake / "python").chmod(0o755)
    resume = tmp_path / "carried"
    resume.mkdir()
    (resume / "learning_gpu_paper_nearest_200gen_seed20260627_history.json").write_text('{"generations": 40}')
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "DETACHED_HOME": str(tmp_path / "home"),
           "RUN_ROOT": str(tmp_path / "root"), "ROUNDING": "nearest", "GENERATIONS": "200", "RESUME": str(resume),
           "COPY_EVERY": "0.5"}
    script = Path(__file__).resolve().parents[1] / "bench" / "learning_paper_detached.sh"

    def detached(*args):
        done = subprocess.run(["bash", str(script), *map(str, args)], env=env, capture_output=True, text=True,
                              cwd=script.parents[1], timeout=120)
        return done.returncode, done.stdout

    def generations(folder, seed):
        return json.loads((folder / f"learning_gpu_paper_nearest_200gen_seed{seed}_history.json").read_text())[
            "generations"]

    def trained_beyond(least: dict) -> None:
        """Wait until each seed's run has written more generations than least[seed]: the checks below read
        progress, not the clock (a loaded machine starts the stand-ins late)."""
        def now(seed):
            path = tmp_path / "root" / f"seed-{seed}" / "es_history.json"
            return json.loads(path.read_text())["generations"] if path.exists() else 0
        deadline = time.monotonic() + 60
        while any(now(seed) <= n for seed, n in least.items()):
            assert time.monotonic() < deadline, f"the runs did not get past {least} in 60 s"
            time.sleep(0.1)

    rc, out = detached("collect", tmp_path / "none", 1)
    assert rc == 3 and "no run here" in out
    rc, out = detached("start", 600)
    assert rc == 0 and "started" in out
    try:
        assert detached("start", 600)[0] == 1  # one pair of runs at a time
        trained_beyond({20260627: 40, 20260628: 0})
        rc, out = detached("collect", tmp_path / "first", 2)
        assert rc == 0 and "still running" in out
        first = {seed: generations(tmp_path / "first", seed) for seed in (20260627, 20260628)}
        assert first[20260627] > 40 and first[20260628] > 0  # the carried history resumed, the other started
        trained_beyond(first)
        with pytest.raises(subprocess.TimeoutExpired):  # a call cut at its limit mid-wait: its copies are there
            subprocess.run(["bash", str(script), "collect", str(tmp_path / "cut"), "60"], env=env,
                           cwd=script.parents[1], capture_output=True, timeout=10)
        cut = {seed: generations(tmp_path / "cut", seed) for seed in first}
        assert all(cut[seed] > first[seed] for seed in first)
        assert not (tmp_path / "cut" / "logs.txt").exists()  # the logs come only with a call that ends
        rc, out = detached("collect", tmp_path / "last", 1, "stop")
        assert rc == 0 and "finished" in out
        assert len(list((tmp_path / "last").iterdir())) <= 8  # what the device tool brings back
        logs = (tmp_path / "last" / "logs.txt").read_text()
        for seed in first:
            assert generations(tmp_path / "last", seed) > first[seed]
            assert f"vLLM of seed {seed}" in logs
        assert logs.count("abandoned") == 2  # both stopped by SIGINT, as at the script's own time limit
        rc, out = detached("collect", tmp_path / "again", 1)  # after the end: the last state, at once
        assert rc == 0 and generations(tmp_path / "again", 20260627) == generations(tmp_path / "last", 20260627)
    finally:
        session = tmp_path / "home" / "session"
        if session.exists():  # whatever a failed assertion left running
            subprocess.run(["pkill", "-KILL", "-s", session.read_text().strip()], check=False)


def test_the_report_holds_03_evals_held_out_reward_of_the_same_run_when_its_folder_has_both_evaluations(tmp_path):
    history = {"base_digests": ["b0"], "generations": [{"digests": ["t1"]}, {"digests": ["t2"]}]}
    assert learning.stages_eval(tmp_path, history) is None  # a run of bench/learning.py alone

    def evaluated(folder, digests, reward, accuracy):
        held_out = {"reward": {"fitness": "shaped", "mean_at_16": reward}, "mean_at_16": accuracy,
                    "reported": {"mean4": accuracy, "pass4": 2 * accuracy}, "n_problems": 64}
        fileio.write_json_atomic({"checkpoint": {"per_rank_digests": digests}, "datasets": {"learn_heldout": held_out}},
                                 tmp_path / folder / metrics.EVAL_METRICS)

    evaluated("eval-base", ["b0"], 0.05, 0.0)
    assert learning.stages_eval(tmp_path, history) is None  # the trained model not evaluated yet
    evaluated("eval", ["t2"], 0.07, 0.25)
    stages = learning.stages_eval(tmp_path, history)
    assert stages == {"fitness": "shaped", "problems": 64, "samples": 16, "same_weights": True,
                      "base": {"reward": 0.05, "accuracy": 0.0, "mean4": 0.0, "pass4": 0.0},
                      "trained": {"reward": 0.07, "accuracy": 0.25, "mean4": 0.25, "pass4": 0.5}}
    run = {"run_seed": 7, **{name: {part: {"mean": 0.1, "ci_low": 0.0, "ci_high": 0.2}
                                    for part in ("base", "trained", "difference")} | {"difference_ci_above_zero": True}
                             for name in learning.METRICS}, "stages_eval": stages}
    assert ("03_eval.py, shaped reward of 64 held-out problems x 16 samples: 0.050 -> 0.070 (accuracy 0.000 -> "
            "0.250; the run's weights: True)") in learning.format_table([run])
    evaluated("eval", ["t1"], 0.07, 0.25)  # an export of the first generation only: not this run's weights
    assert learning.stages_eval(tmp_path, history)["same_weights"] is False


def test_learning_checks_the_scorer_and_evaluates_the_tier_it_trains_on(tmp_path, monkeypatch):
    """bench/learning.py checks the scorer as the stages do, before it trains (the warm-up) and on its held-out
    episodes (the failure bound: no report from a broken scorer's 0s), and evaluates the held-out additions of the
    tier it trains on (--learn_digits, as 03_eval.py evaluates that run)."""
    calls = []
    monkeypatch.setattr(stage, "check_scorer", lambda: calls.append("check_scorer"))
    train = importlib.import_module("01_train")
    monkeypatch.setattr(train, "main", lambda argv: calls.append("train") or {"generations": [],
                                                                               "base_digests": ["b"]})

    def evaluate(cfg, history, problems, samples):
        calls.append(problems)
        records = [{"problem_id": p["id"], "score": 0.0, "score_method": "score_error"} for p in problems]
        return records, records, ["b"], 1.0

    monkeypatch.setattr(learning, "evaluate_base_and_trained", evaluate)
    with pytest.raises(stage.ScorerFailure, match=r"held-out base model: the scorer failed on 4 of 4 episodes"):
        learning.main(["--learn_digits=4", "--heldout=4", "--seeds=1", f"--run_root={tmp_path}",
                       f"--out={tmp_path / 'report.json'}"])
    assert calls == ["check_scorer", "train", data.problems_from("learn_heldout", 0, 4)[:4]]
    assert not (tmp_path / "report.json").exists()
    for digits in (0, 6):  # 03_eval.py's held-out set of each tier
        assert learning.heldout_problems(5, digits) == data.problems_from("learn_heldout", 0, digits)[:5]
