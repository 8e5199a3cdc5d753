"""bench/member_eval.py, the skeptic's control: generation 0's best member alone (its seed and sigma, no update)
evaluated on the run's held-out sets as 03_eval.py evaluates a checkpoint, in files bench/compute_stages_summary.py
reads. The engine pool is a stand-in here (no engine): what is checked is which member, which episodes, which files."""

import dataclasses
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import compute_stages_summary  # noqa: E402
import member_eval  # noqa: E402

import common  # noqa: E402
from agentic_es import cli, compute_task, stage  # noqa: E402
from agentic_es.history import HISTORY_FILE, HISTORY_FORMAT  # noqa: E402
from agentic_es.metrics import EVAL_SAMPLES  # noqa: E402

SEEDS, REWARDS, SIGMA = [11, 22, 33, 44], [0.0, 0.25, 0.5, 0.5], 2e-3  # the best: member 2 (the first of equals)


def write_history(run_dir: Path, level: int = 2) -> None:
    cfg = cli.parse_config(["--preset=compute", "--model=tiny-qwen3-dense", "--population=4", "--eval_problems=2",
                            f"--compute_level={level}", f"--run_dir={run_dir}"])
    record = {"generation": 0, "sigma": SIGMA, "alpha": cfg.alpha, "seeds": SEEDS, "rewards": REWARDS,
              "z": common.zscore(REWARDS), "problem_ids": ["p"], "digests": ["d0", "d1"], "timings": {}}
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / HISTORY_FILE).write_text(json.dumps({
        "format": HISTORY_FORMAT, "config": dataclasses.asdict(cfg), "base_model": cfg.model,
        "base_digests": ["b0", "b1"], "generations": [record]}))


class Engine:
    def __init__(self, log):
        self.log = log

    def perturb(self, seed, sigma):
        self.log.append(("perturb", seed, sigma))

    def run_agent(self, jobs, desc=None, on_record=None):
        self.log.append(("run", [(p["id"], i) for p, i in jobs]))
        return [{"problem_id": p["id"], "sample_index": i, "seed": i, "score": float(i % 2), "score_method": "x",
                 "finish_reason": "final_answer", "turns": 2, "bash_calls": 1, "completion_tokens": 9,
                 "reply_finish_reasons": ["stop"],
                 "messages": [{"role": "system", "content": common.SYSTEM_PROMPT},
                              {"role": "user", "content": common.user_prompt(p["question"])}]} for p, i in jobs]

    def restore(self):
        self.log.append(("restore",))


def stand_in_pool(log):
    class Pool:
        def __init__(self, cfg, model_path, **kwargs):
            log.append(("pool", cfg.compute_level, kwargs.get("perturbs", True)))

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def map(self, step, tasks, desc, noun):
            return [step(Engine(log), *task) for task in tasks]
    return Pool


@pytest.fixture
def stubbed(monkeypatch):
    log = []
    monkeypatch.setattr(member_eval, "EnginePool", stand_in_pool(log))
    monkeypatch.setattr(member_eval.models, "resolve_model", lambda name, *a, **k: name)
    monkeypatch.setattr(common, "check_sandbox", lambda *a, **k: [])
    monkeypatch.setattr(stage, "check_scorer", lambda: None)
    return log


def test_the_best_member_of_generation_0_on_the_runs_held_out_sets(tmp_path, stubbed):
    write_history(tmp_path / "run")
    metrics = member_eval.main([f"--run_dir={tmp_path / 'run'}"])
    assert metrics["checkpoint"] == {"kind": "member", "generation": 0, "member": 2, "seed": 33, "sigma": SIGMA,
                                     "fitness": 0.5}
    assert stubbed[0] == ("pool", 2, True)  # the run's level, an engine that perturbs
    assert stubbed[1] == ("perturb", 33, SIGMA) and stubbed[-1] == ("restore",)  # once, around every episode
    expected = [(p["id"], i) for split in ("heldout", "families") for p in compute_task.problems(split, 2, 2)
                for i in range(EVAL_SAMPLES)]
    assert stubbed[2] == ("run", expected)
    out = tmp_path / "run" / "eval-best-member"
    for name in ("compute_heldout", "compute_families"):
        eval16 = json.loads((out / f"{name}_eval16.json").read_text())
        assert eval16["checkpoint"]["seed"] == 33 and len(eval16["records"]) == 2 * EVAL_SAMPLES
        assert "messages" not in eval16["records"][0] and metrics["datasets"][name]["mean_at_16"] == 0.5


def test_the_summary_compares_the_member_with_the_base(tmp_path, stubbed):
    write_history(tmp_path / "run")
    member_eval.main([f"--run_dir={tmp_path / 'run'}"])
    member_eval.main([f"--run_dir={tmp_path / 'run'}", f"--out={tmp_path / 'again'}"])  # the same episodes again
    report = compute_stages_summary.main([f"--trained={tmp_path / 'run' / 'eval-best-member'}",
                                          f"--base={tmp_path / 'again'}"])
    assert sorted(report["sets"]) == ["compute_families", "compute_heldout"]
    assert report["sets"]["compute_heldout"]["metrics"]["mean_at_16"]["difference"]["mean"] == 0


def test_a_history_without_a_generation_is_refused(tmp_path, stubbed):
    write_history(tmp_path / "run")
    path = tmp_path / "run" / HISTORY_FILE
    path.write_text(json.dumps(dict(json.loads(path.read_text()), generations=[])))
    with pytest.raises(stage.ConfigError, match="no generation"):
        member_eval.main([f"--run_dir={tmp_path / 'run'}"])
