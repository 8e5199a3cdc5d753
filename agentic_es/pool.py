"""The engine pool: K engines evaluate population members (training) or episodes (evaluation, replay) at once,
through one work queue (a thread per engine takes the next task when its engine is free). After each generation
every engine applies the same update from (seeds, coefficients), so no weights travel; their per-rank digests must
then agree.

Placement, fixed: a node's GPUs form G = GPUs // tensor_parallel_size groups of consecutive GPUs (group j: GPUs
j*tp .. j*tp+tp-1); engine k runs on group k mod G. Engines spread over the groups first and share a group's GPUs
(co-locate) only when K > G; co-located engines start one after another, also across processes (vLLM sizes its
memory from what is free when it starts: engine.gpu_memory_lock), and at tensor_parallel_size > 1 they need CUDA
MPS (without it their NCCL collectives stall under time-slicing). Every GPU engine, one or many, gets its memory
plan (weights, KV cache, where its exact-restore copy or patch goes) from what its node has free when it starts, and
takes that copy or patch at start. A read-only pool (export, evaluation, replay: perturbs=False) never perturbs: its
engines plan weights and KV cache alone and hold no restore memory. On one node the K engines live in this process;
with --ray_address they are Ray actors, one placement group per GPU group, on the nodes of a cluster (ray_pool.py,
imported, with Ray, only then).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import math
import os
import subprocess
import threading
import time
import warnings
from pathlib import Path

import torch

import common
from agentic_es import checkpoint_noise, engine, fileio, history, restore_patch, tracking, vllm_platform


GIB = 1 << 30
# memory a GPU engine needs besides vLLM's share (gpu_memory_utilization x GPU memory): its CUDA context, NCCL
# buffers and CUDA graphs (a reserve, not a measurement); and within that share, room for activations
ENGINE_OVERHEAD_BYTES = 1 * GIB
ACTIVATION_RESERVE_BYTES = 2 * GIB
HOST_PINNED_SHARE = 0.8  # exact-restore copies in pinned host memory may take this share of the node's free RAM
# after SIGTERM or Ctrl-C, how long the pool waits for its other threads' calls to stop before the engines close (one
# still at work then finds its engine closed: an EngineFailure in that thread, no episode recorded)
POOL_STOP_JOIN_S = 30
MPS_PIPE_DIRECTORY = "/tmp/nvidia-mps"  # nvidia-cuda-mps-control's default when CUDA_MPS_PIPE_DIRECTORY is unset
MPS_COMMANDS = ("export CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps CUDA_MPS_LOG_DIRECTORY=/tmp/nvidia-mps-log; "
                "mkdir -p $CUDA_MPS_LOG_DIRECTORY; nvidia-cuda-mps-control -d   (as root; stop: echo quit | "
                "nvidia-cuda-mps-control)")


class EnginesDisagree(common.EngineFailure):
    """Two engines of the pool hold different weights after the same updates: their results cannot be mixed."""


# ---- placement: pure functions ----

def pool_size(cfg: common.Config, device: str) -> int:
    """--engines, else one engine per tensor_parallel_size GPUs (of the Ray cluster with --ray_address), at least
    one; on CPU one unless asked."""
    if cfg.engines:
        return cfg.engines
    if device != "cuda":
        return 1
    if cfg.ray_address:
        from agentic_es import ray_pool  # imports Ray

        ray_pool.start_ray(cfg.ray_address)
        return max(1, ray_pool.ray_gpu_groups(cfg.tensor_parallel_size))
    return max(1, torch.cuda.device_count() // cfg.tensor_parallel_size)


def gpu_groups(gpu_ids: list[str], tensor_parallel_size: int) -> list[list[str]]:
    """A node's GPUs in groups of tensor_parallel_size consecutive ones (a remainder stays unused)."""
    tp = tensor_parallel_size
    return [gpu_ids[j * tp:(j + 1) * tp] for j in range(len(gpu_ids) // tp)]


def place_engines(engines: int, groups: int) -> list[int]:
    """The GPU group of each engine: k mod G, so that engines share GPUs only when there are more than groups."""
    if groups < 1:
        raise common.ConfigError("no GPU group to place an engine on (fewer GPUs than tensor_parallel_size)")
    return [k % groups for k in range(engines)]


def cpu_binding(index: int, tensor_parallel_size: int, cores: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for engine `index` of a CPU pool: its own core per rank ('0', '1'; '0|1', '2|3' at
    TP=2), wrapping around when a node has more ranks than cores (a local pool refuses that: check_cpu_pool)."""
    return "|".join(str((index * tensor_parallel_size + r) % cores) for r in range(tensor_parallel_size))


def check_cpu_pool(engines: int, tensor_parallel_size: int, cores: int) -> None:
    """A local CPU pool binds every TP rank of every engine to a core of its own: ranks beyond the cores would only
    take turns on the same cores (no faster than fewer engines), each engine holding its own weights and KV cache."""
    ranks = engines * tensor_parallel_size
    if ranks > cores:
        raise common.ConfigError(f"engines={engines} x tensor_parallel_size={tensor_parallel_size} = {ranks} TP ranks, "
                                 f"but this machine has {cores} CPU cores, one per rank: use --engines="
                                 f"{max(1, cores // tensor_parallel_size)} or fewer")


def parameter_count(config: dict, folder: str | Path | None = None) -> int:
    """Parameters of a model: counted from the safetensors headers in `folder` when it holds weight files (exact,
    any architecture), else from its config.json for the layouts formula_parameter_count knows."""
    stored = safetensors_elements(folder) if folder is not None else None
    return sum(stored.values()) if stored is not None else formula_parameter_count(config)


def safetensors_elements(folder: str | Path) -> dict[str, int] | None:
    """Elements per stored dtype ("BF16", "F32", ...) of every tensor in a folder's safetensors files, from their
    JSON headers (no weights read): the files its index names when it has one (a folder may keep a consolidated
    copy beside the shards), else all. None when it has none."""
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    files = (sorted({folder / f for f in json.loads(index.read_text())["weight_map"].values()}) if index.exists()
             else sorted(folder.glob("*.safetensors")))
    if not files:
        return None
    elements = {}
    for file in files:
        with open(file, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))  # 8-byte length, then the JSON
        for name, t in header.items():
            if name != "__metadata__":
                elements[t["dtype"]] = elements.get(t["dtype"], 0) + math.prod(t["shape"])
    return elements


SAFETENSORS_FLOATS = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def held_elements(stored: dict[str, int], dtype: torch.dtype) -> dict[torch.dtype, int]:
    """Elements per dtype an engine run at `dtype` holds of a checkpoint with `stored` elements per safetensors
    dtype. vLLM casts the weights to the run's dtype, except the tensors a model keeps wider, which a checkpoint
    stores wider than its other weights: a floating dtype wider than both the run's and the one most elements are
    stored in is held as stored. BF16 weights with an F32 router bias, run in bfloat16: both as stored; an all-F32
    checkpoint run in bfloat16: all bfloat16; BF16 weights with an F32 bias run in float32: all float32."""
    main = max(stored, key=stored.get)
    floor = max(dtype.itemsize, SAFETENSORS_FLOATS[main].itemsize if main in SAFETENSORS_FLOATS else 0)
    held = {}
    for name, n in stored.items():
        kept = SAFETENSORS_FLOATS.get(name)
        as_dtype = kept if kept is not None and kept.itemsize > floor else dtype
        held[as_dtype] = held.get(as_dtype, 0) + n
    return held


# the model types whose parameters formula_parameter_count adds up (embeddings, attention with the q/k norms of
# Qwen3, dense or expert MLPs with their router, norms); any other is counted from its weight files
FORMULA_MODEL_TYPES = ("llama", "mistral", "mixtral", "qwen3", "qwen3_moe")


def formula_parameter_count(config: dict) -> int:
    """Parameters of a checkpoint of FORMULA_MODEL_TYPES from its config.json alone; a ConfigError for others."""
    model_type = config.get("model_type")
    if model_type not in FORMULA_MODEL_TYPES:
        raise common.ConfigError(f"cannot size the engines' memory: the model folder has no safetensors weights to "
                                 f"count its parameters from, and its config.json (model_type {model_type!r}) is not "
                                 f"one of the layouts counted from the config ({', '.join(FORMULA_MODEL_TYPES)})")
    h, layers, vocab = config["hidden_size"], config["num_hidden_layers"], config["vocab_size"]
    heads, head_dim = config["num_attention_heads"], _head_dim(config)
    q, kv = heads * head_dim, config.get("num_key_value_heads", heads) * head_dim
    attention = 2 * h * q + 2 * h * kv + (2 * head_dim if model_type.startswith("qwen3") else 0)
    experts = config.get("num_experts") or config.get("num_local_experts")  # (Mixtral, transformers 5: the latter)
    if experts:
        expert_size = config.get("moe_intermediate_size") or config["intermediate_size"]  # Mixtral: the latter
        mlp = experts * 3 * h * expert_size + h * experts
    else:
        mlp = 3 * h * config["intermediate_size"]
    embeddings = vocab * h * (1 if config.get("tie_word_embeddings") else 2)
    return embeddings + h + layers * (attention + mlp + 2 * h)


def language_model_config(config: dict) -> dict:
    """The part of a config.json that sizes the language model (layers, heads): the config itself, or its
    text_config where a model with a vision or audio tower nests it."""
    text = config if "num_hidden_layers" in config or "text_config" not in config else config["text_config"]
    missing = [k for k in ("num_hidden_layers", "num_attention_heads", "hidden_size") if k not in text]
    if missing:
        raise common.ConfigError(f"cannot size the engines' memory: config.json (model_type "
                                 f"{config.get('model_type')!r}) has no {', '.join(missing)}, at its top level or in a "
                                 f"text_config")
    return text


def engine_memory_needs(config: dict, cfg: common.Config, folder: str | Path | None = None) -> dict:
    """Bytes per GPU of one engine: its weights (one TP rank's share; counted from the weight files in `folder`
    when it has them), the KV cache of one full-length sequence, and its restore patch's bound (restore="patch")."""
    dtype = getattr(torch, cfg.dtype)
    tp = cfg.tensor_parallel_size
    text = language_model_config(config)
    kv_heads = max(1, text.get("num_key_value_heads", text["num_attention_heads"]) // tp)
    stored = safetensors_elements(folder) if folder is not None else None
    held = held_elements(stored, dtype) if stored else {dtype: formula_parameter_count(config)}
    per_rank = {d: n // tp for d, n in held.items()}
    return {"weights_bytes": sum(n * d.itemsize for d, n in per_rank.items()),
            "sequence_kv_bytes": 2 * text["num_hidden_layers"] * kv_heads * _head_dim(text) * dtype.itemsize
                                 * cfg.max_model_len,
            "patch_bytes": restore_patch.patch_bytes(per_rank, restore_patch.patch_capacity(cfg))}


def _head_dim(config: dict) -> int:
    return config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]


def plan_gpu_memory(*, engines_per_gpu: int, engines_on_node: int, gpu_total: int, gpu_free: int,
                    host_free: int, utilization: float, weights_bytes: int, sequence_kv_bytes: int,
                    restore: str | None, tensor_parallel_size: int, patch_bytes: int = 0) -> dict:
    """Whether `engines_per_gpu` engines fit on each GPU of a group, and where their exact-restore copies go: on
    the GPU where they fit, else in pinned host memory. restore="patch" keeps each engine's patch (`patch_bytes`,
    its bound, allocated whole at start) on the GPU or is refused: it has no host fallback. restore=None: engines
    that never perturb (a read-only pool), weights and KV cache alone. Refuses (ConfigError) with the numbers when
    they do not fit. Every engine gets `utilization` x gpu_total from vLLM, plus ENGINE_OVERHEAD_BYTES outside it."""
    gib = lambda b: f"{b / GIB:.1f} GiB"  # noqa: E731
    share = utilization * gpu_total
    kv_room = share - weights_bytes - ACTIVATION_RESERVE_BYTES
    numbers = (f"per GPU: {gib(gpu_total)} total, {gib(gpu_free)} free; per engine: weights {gib(weights_bytes)}, "
               f"vLLM share {utilization} x {gib(gpu_total)} = {gib(share)}, one {gib(sequence_kv_bytes)} "
               f"max_model_len sequence of KV cache")
    if kv_room < sequence_kv_bytes:
        raise common.ConfigError(f"an engine's vLLM share does not hold its weights, {gib(ACTIVATION_RESERVE_BYTES)} "
                                 f"of activations and one max_model_len sequence ({numbers}): raise "
                                 "--gpu_memory_utilization or lower --max_model_len")
    vllm_bytes = engines_per_gpu * (share + ENGINE_OVERHEAD_BYTES)
    if vllm_bytes > gpu_free:
        most = (gpu_free / engines_per_gpu - ENGINE_OVERHEAD_BYTES) / gpu_total
        raise common.ConfigError(f"{engines_per_gpu} engines per GPU need {gib(vllm_bytes)} ({numbers}, "
                                 f"{gib(ENGINE_OVERHEAD_BYTES)} overhead each): use "
                                 f"--gpu_memory_utilization={most:.2f} or less, or fewer --engines")
    if restore == "patch" and vllm_bytes + engines_per_gpu * patch_bytes > gpu_free:
        raise common.ConfigError(f"the restore patches do not fit on the GPUs ({engines_per_gpu} x {gib(patch_bytes)} "
                                 f"beside {gib(vllm_bytes)} of vLLM, {gib(gpu_free)} free; a patch is a bit per "
                                 "element plus patch_capacity of the weights): lower --patch_capacity or "
                                 "--gpu_memory_utilization, use fewer --engines, or --restore=copy_host")
    copies_on_gpu = engines_per_gpu * weights_bytes
    host_copies = engines_on_node * tensor_parallel_size * weights_bytes
    if restore == "copy_device" and vllm_bytes + copies_on_gpu > gpu_free:
        restore = "copy_host"  # as exact; a host-to-device copy per restore instead of a device copy
    if restore == "copy_host" and host_copies > HOST_PINNED_SHARE * host_free:
        raise common.ConfigError(f"the exact-restore copies fit neither on the GPUs ({engines_per_gpu} x "
                                 f"{gib(weights_bytes)} beside {gib(vllm_bytes)} of vLLM, {gib(gpu_free)} free) nor in "
                                 f"pinned host memory ({engines_on_node} engines x {tensor_parallel_size} ranks x "
                                 f"{gib(weights_bytes)} = {gib(host_copies)}, {HOST_PINNED_SHARE:.0%} of "
                                 f"{gib(host_free)} free); lower --gpu_memory_utilization or use fewer --engines")
    return {"restore": restore, "engines_per_gpu": engines_per_gpu, "gpu_total_bytes": gpu_total,
            "gpu_free_bytes": gpu_free, "vllm_share_bytes": int(share), "weights_bytes": weights_bytes,
            "kv_cache_bytes": int(kv_room), "device_copy_bytes": weights_bytes if restore == "copy_device" else 0,
            "host_copy_bytes": weights_bytes * tensor_parallel_size if restore == "copy_host" else 0,
            "device_patch_bytes": patch_bytes if restore == "patch" else 0}


def check_colocation(engines_per_group: int, tensor_parallel_size: int, mps: bool) -> str | None:
    """Co-located engines at TP > 1 without MPS are refused (their NCCL collectives stall under time-slicing:
    docs/pool.md, "CUDA MPS"); at TP=1 they run with a warning (returned)."""
    if engines_per_group <= 1 or mps:
        return None
    if tensor_parallel_size > 1:
        raise common.ConfigError(f"{engines_per_group} engines at tensor_parallel_size={tensor_parallel_size} would "
                                 "share GPUs without CUDA MPS: their NCCL collectives stall under time-slicing. Start "
                                 f"MPS on the node first:\n  {MPS_COMMANDS}\nor use --engines <= GPUs // "
                                 f"tensor_parallel_size")
    return (f"{engines_per_group} engines share each GPU without CUDA MPS: their kernels only time-slice, never run "
            "at once. Start MPS: " + MPS_COMMANDS)


def engines_to_plan(where: list[int], k: int) -> dict:
    """What engine k's memory plan must still make room for, given the GPU group of each engine of a node in start
    order (`where`): the engines of its group from k on, and the exact-restore copies still to take on the node
    (engines from k on). Every earlier engine already holds its memory, its restore copy or patch included."""
    return {"engines_per_gpu": where[k:].count(where[k]), "engines_on_node": len(where) - k}


def start_gpu_engine(cfg: common.Config, model_path: str, gpus: list[str], *, engines_per_gpu: int,
                     engines_on_node: int, perturbs: bool = True, **engine_kwargs) -> engine.Engine:
    """One GPU engine of a pool, under the machine's GPU memory lock: its memory plan from what is free now (after
    every engine started before it, this run's or another's; the refusal names the numbers, before this engine
    starts), its start, and its exact-restore copy or patch (none for an engine that never perturbs), so that the
    next start sees that memory used."""
    with engine.gpu_memory_lock():
        report = node_report(gpus)
        if report["gpu_total_bytes"] is not None:  # nvidia-smi told
            config = json.loads((Path(model_path) / "config.json").read_text())
            plan = plan_gpu_memory(
                engines_per_gpu=engines_per_gpu, engines_on_node=engines_on_node,
                gpu_total=report["gpu_total_bytes"], gpu_free=report["gpu_free_bytes"],
                host_free=report["host_free_bytes"], utilization=cfg.gpu_memory_utilization,
                restore=cfg.restore if perturbs else None, tensor_parallel_size=cfg.tensor_parallel_size,
                **engine_memory_needs(config, cfg, model_path))
            if perturbs:
                cfg = dataclasses.replace(cfg, restore=plan["restore"])
        started = engine.Engine(cfg, model_path, perturbs=perturbs, **engine_kwargs)
        try:
            if perturbs:
                started.reserve_restore_copy()
        except BaseException:
            started.close()
            raise
        return started


# ---- what a node has ----

def mps_running() -> bool:
    """Whether an MPS control daemon serves this process's GPUs: its control pipe exists in the pipe directory this
    process would connect through, and the daemon runs."""
    import psutil

    pipe = os.path.join(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", MPS_PIPE_DIRECTORY), "control")
    return os.path.exists(pipe) and any(p.info["name"] == "nvidia-cuda-mps-control"
                                        for p in psutil.process_iter(["name"]))


def visible_gpus() -> list[str]:
    """This process's GPUs as CUDA_VISIBLE_DEVICES names them (all of the node's when it is unset)."""
    count = torch.cuda.device_count()
    named = [g for g in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if g.strip()]
    return named[:count] if named else [str(i) for i in range(count)]


def gpu_memory(gpu_ids: list[str]) -> tuple[int, int] | None:
    """(total, free) bytes of the smallest / fullest of these GPUs, from nvidia-smi (no CUDA context here)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,uuid,memory.total,memory.free",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    rows = [[f.strip() for f in line.split(",")] for line in out.strip().splitlines()]
    picked = [r for r in rows if r[0] in gpu_ids or r[1] in gpu_ids]
    if not picked:
        return None
    return min(int(r[2]) for r in picked) << 20, min(int(r[3]) for r in picked) << 20


def node_report(gpu_ids: list[str]) -> dict:
    """What placement needs to know about a node: its GPUs' memory, free host memory, MPS, CPU cores."""
    import psutil

    memory = gpu_memory(gpu_ids) if gpu_ids else None
    return {"gpus": gpu_ids, "gpu_total_bytes": memory and memory[0], "gpu_free_bytes": memory and memory[1],
            "host_free_bytes": psutil.virtual_memory().available, "mps": mps_running(), "cores": os.cpu_count() or 1}


@contextlib.contextmanager
def environment(**variables):
    """os.environ with these variables set for the block (an engine's processes inherit them at start)."""
    saved = {k: os.environ.get(k) for k in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ---- the pool ----

class EnginePool(fileio.ClosedOnExit):
    """K engines with the facade the scripts need: map (a step on the next free engine: training's members),
    run_agent (evaluation, replay), update, digests (checked to agree across engines), rpc and
    parameter_names_sha256 (engine 0's). A context
    manager; leaving it shuts every engine down. An engine that dies fails the call with an EngineFailure naming
    it; the stage then resumes from its files when started again. engine_kwargs go to each Engine: perturbs=False
    starts a read-only pool (no restore memory; perturbing is refused)."""

    def __init__(self, cfg: common.Config, model_path: str, **engine_kwargs):
        self.cfg, self.engines, self.placement_groups = cfg, [], []  # (Ray's, with --ray_address)
        self.device = vllm_platform.device_type()
        if not cfg.ray_address:  # before any engine starts: the TP size, and on the CPU the pool, must fit here
            vllm_platform.check_placement(cfg.tensor_parallel_size, self.device,
                                          len(visible_gpus()) if self.device == "cuda" else None)
            if self.device != "cuda":
                check_cpu_pool(pool_size(cfg, self.device), cfg.tensor_parallel_size, len(os.sched_getaffinity(0)))
        self.size = pool_size(cfg, self.device)
        self.placement = []  # per engine: where it runs (node, GPUs or CPU cores, restore copy)
        try:
            if cfg.ray_address:
                from agentic_es import ray_pool  # imports Ray

                ray_pool.start_engines(self, model_path, engine_kwargs)
                self.device = self.placement[0]["device"]  # the engines' (the driver may have no GPU)
            else:
                self._start_local(model_path, engine_kwargs)
            self.check_same_devices(self._each("rpc", "es_device"))
        except BaseException:
            self.close()
            raise

    # ---- starting and stopping ----
    def check_colocation_per_group(self, engines_per_group: list[int], mps: list[bool]) -> None:
        """The MPS rule for every GPU group, before any engine starts."""
        for count, mps_on in zip(engines_per_group, mps):
            warning = check_colocation(count, self.cfg.tensor_parallel_size, mps_on)
            if warning:
                warnings.warn(warning, stacklevel=3)

    def _start_local(self, model_path: str, engine_kwargs: dict) -> None:
        """K engines in this process (one node), started one after another on their GPU groups (each planned, one
        engine too) or CPU cores."""
        tp = self.cfg.tensor_parallel_size
        if self.device != "cuda" and self.size == 1:
            self.engines.append(engine.Engine(self.cfg, model_path, **engine_kwargs))
            self.placement.append({"node": "local", "devices": "all visible"})
            return
        if self.device != "cuda":
            cores = os.cpu_count() or 1
            for k in range(self.size):
                with environment(VLLM_CPU_OMP_THREADS_BIND=cpu_binding(k, tp, cores)):
                    self.engines.append(engine.Engine(self.cfg, model_path, **engine_kwargs))
                self.record_start({"node": "local", "cpu_cores": cpu_binding(k, tp, cores)})
            return
        groups = gpu_groups(visible_gpus(), tp)
        where = place_engines(self.size, len(groups))
        counts = [where.count(j) for j in range(len(groups))]
        mps = mps_running()
        self.check_colocation_per_group(counts, [mps] * len(groups))
        for k, j in enumerate(where):
            with environment(CUDA_VISIBLE_DEVICES=",".join(groups[j])):
                started = start_gpu_engine(self.cfg, model_path, groups[j], **engines_to_plan(where, k),
                                          **engine_kwargs)
            self.engines.append(started)
            self.record_start({"node": "local", "gpus": groups[j], "group": j, "co_located": counts[j],
                           "restore": started.restore_mode, "mps": mps})

    def record_start(self, placement: dict) -> None:
        """An engine has started: where it runs, kept (self.placement) and printed."""
        self.placement.append(placement)
        shown = ", ".join(f"{k} {v}" for k, v in placement.items() if k not in ("pid", "core_pids", "device"))
        print(f"[pool] engine {len(self.placement) - 1} of {self.size} started: {shown}", flush=True)

    def close(self) -> None:
        """Shut every engine down (also after a failure of one of them)."""
        for each in self.engines:
            with contextlib.suppress(Exception):  # a dead engine has nothing left to shut down
                each.close()
        self.engines = []
        if self.placement_groups:
            from agentic_es import ray_pool

            ray_pool.remove_placement_groups(self.placement_groups)
            self.placement_groups = []

    # ---- calls on every engine ----
    def _name(self, k: int) -> str:
        return f"engine {k} of {self.size}"

    def _named(self, k: int, what: str, exc: BaseException) -> BaseException:
        """An engine's failure, naming the engine when the pool has several."""
        if self.size == 1 or isinstance(exc, (common.ConfigError, KeyboardInterrupt)) or str(exc).startswith("engine "):
            return exc
        if isinstance(exc, common.EngineFailure):
            return common.EngineFailure(f"{self._name(k)} failed during {what}: {exc}")
        return exc

    def _each(self, method: str, *args, **kwargs) -> list:
        """engine.method(*args) on every engine at once; results in engine order."""
        if len(self.engines) == 1:
            return [getattr(self.engines[0], method)(*args, **kwargs)]
        with concurrent.futures.ThreadPoolExecutor(len(self.engines)) as threads:
            futures = [threads.submit(getattr(e, method), *args, **kwargs) for e in self.engines]
            results = []
            for k, future in enumerate(futures):
                try:
                    results.append(future.result())
                except Exception as exc:
                    raise self._named(k, method, exc) from exc
            return results

    def stop_threads(self, threads: list[threading.Thread]) -> None:
        """Cancel the engine calls the work queue's threads wait on and join those threads, for at most
        POOL_STOP_JOIN_S in all."""
        for each in self.engines:
            with contextlib.suppress(Exception):  # a dead engine has no call to stop
                each.stop_calls()
        deadline = time.monotonic() + POOL_STOP_JOIN_S
        for thread in threads:
            if thread.ident is not None:  # (a stop while they start: one not started never runs)
                thread.join(timeout=max(0.0, deadline - time.monotonic()))

    def check_same_devices(self, devices: list[list[dict]]) -> None:
        """The noise streams depend on the device model: a mixed pool would train on two different noises."""
        if any(d != devices[0] for d in devices):
            raise common.ConfigError("the engines run on different device models (" + "; ".join(
                f"engine {k}: {history.describe_devices(d)}" for k, d in enumerate(devices)) + "); the noise depends "
                "on the device model, so every engine of a pool must use the same one")

    @property
    def restore_modes(self) -> list[str]:
        """How each engine undoes a perturbation (Engine.restore_mode), in engine order: the run's --restore, except
        where an engine's memory plan held its copy in pinned host memory (copy_host) instead of on the GPU."""
        return [each.restore_mode for each in self.engines]

    def rpc(self, method: str, **kwargs) -> list:
        return self._each("rpc", method, **kwargs)[0]

    def parameter_names_sha256(self) -> str:
        return self._each("parameter_names_sha256")[0]

    def update(self, seeds: list[int], coeffs: list[float]) -> None:
        """The same update on every engine."""
        self._each("update", seeds, coeffs)

    def checkpoint_sums(self) -> tuple[dict[str, int], dict[str, list[int]]]:
        """Engine 0's checkpoint digest sums, after checking that every engine holds the same bits (one pass)."""
        per_engine = self._each("checkpoint_sums")
        self._check_agreement([[checkpoint_noise.combine_checkpoint_digest(*sums, self.cfg.dtype)]
                               for sums in per_engine])
        return per_engine[0]

    def digests(self) -> list[str]:
        """Engine 0's per-rank digests, after checking that every engine holds the same bits."""
        per_engine = self._each("digests")
        self._check_agreement(per_engine)
        return per_engine[0]

    def base_digests(self, model_path: str) -> list[str]:
        """Engine.base_digests for the pool: its engines hold the same base (digests() checks it)."""
        if common.is_checkpoint_noise(self.cfg):
            return checkpoint_noise.checked_checkpoint_digests(self, model_path, self.cfg.dtype)
        return self.digests()

    def _check_agreement(self, per_engine: list[list[str]]) -> None:
        for k, digests in enumerate(per_engine[1:], start=1):
            ranks = [r for r, (mine, first) in enumerate(zip(digests, per_engine[0])) if mine != first]
            if ranks or len(digests) != len(per_engine[0]):
                raise EnginesDisagree(f"engine {k} of {self.size} disagrees with engine 0 on the weights of rank "
                                      f"{ranks[0] if ranks else '?'} ({digests} != {per_engine[0]}): the pool's "
                                      "engines no longer hold the same theta")

    # ---- the work ----
    def map(self, step, tasks: list[tuple], desc: str, noun: str) -> list:
        """step(engine, *task, desc=..., on_record=...) for every task, each on the next free engine (the work
        queue: work); results in task order. step: what one engine does with a task (01_train.py maps
        common.evaluate_member over the members: perturb, the agent, restore); desc: that engine's progress bar of
        the task's episodes, where the pool has one engine (with several, the pool draws one bar for all)."""
        return self.work(len(tasks), desc, noun, lambda engine, i, on_record: step(
            engine, *tasks[i], desc=f"{noun} {i} episodes" if self.size == 1 else None, on_record=on_record))

    def run_agent(self, jobs: list[tuple[dict, int]], desc: str = "episodes", on_record=None) -> list[dict]:
        """Engine.run_agent spread over the pool: contiguous slices of `jobs` (a problem's samples stay together,
        sharing the prefix cache) handed to free engines; records in input order; on_record as episodes end."""
        if self.size == 1:
            return self.engines[0].run_agent(jobs, desc=desc, on_record=on_record)
        size = max(1, math.ceil(len(jobs) / self.size))
        slices = [jobs[i:i + size] for i in range(0, len(jobs), size)]
        results = self.work(len(slices), desc, "slice", lambda worker, i, record: worker.run_agent(
            slices[i], desc=None, on_record=record), on_record=on_record, total_episodes=len(jobs))
        return [record for records in results for record in records]

    def work(self, tasks: int, desc: str, noun: str, run, on_record=None, total_episodes: int = 0) -> list:
        """The work queue: one thread per engine takes the next task i when its engine is free and runs
        run(engine, i, on_record), so one task's straggler overlaps the others' work. Results are keyed by task
        index, never by completion order. The first failure stops the queue: the other engines finish the task they
        hold (their episodes still reach on_record), and then that first failure is raised, naming its engine, so
        that no engine is still at work when the caller goes on (to close the engines, say). A stop of this thread
        (SIGTERM, Ctrl-C) cancels the calls the other threads wait on and joins them (at most POOL_STOP_JOIN_S)
        before it is raised: the engines close under no request, and the episodes that ended reached on_record."""
        results, todo, failures = [None] * tasks, list(range(tasks)), []
        lock, status = threading.Lock(), ["idle"] * self.size
        bar = tracking.progress_bar(total=total_episodes or tasks, desc=desc, leave=False)

        def recorder(k: int, i: int):
            episodes = [0]

            def record(r: dict) -> None:
                with lock:
                    episodes[0] += 1
                    status[k] = f"{noun} {i}, {episodes[0]} episodes"
                    if total_episodes:
                        bar.update(1)
                    bar.set_postfix_str("  ".join(f"engine {e}: {s}" for e, s in enumerate(status)))
                    if on_record is not None:
                        on_record(r)
            return record

        def worker(k: int) -> None:
            while True:
                with lock:
                    if failures or not todo:
                        return
                    i = todo.pop(0)
                    status[k] = f"{noun} {i}"
                try:
                    results[i] = run(self.engines[k], i, recorder(k, i))
                except BaseException as exc:  # noqa: BLE001 (handed to the main thread)
                    with lock:
                        failures.append((k, i, exc))
                    return
                with lock:
                    status[k] = "idle"
                    if not total_episodes:
                        bar.update(1)

        threads = []
        try:
            if self.size == 1:
                worker(0)  # in this thread: nothing to overlap
            else:
                threads = [threading.Thread(target=worker, args=(k,), name=f"es-pool-{k}", daemon=True)
                           for k in range(self.size)]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    while thread.is_alive():
                        thread.join(timeout=0.2)  # short waits: SIGTERM/Ctrl-C reach this (main) thread
        except BaseException:  # (SIGTERM/Ctrl-C): the other threads stop before the caller closes the engines
            with lock:
                todo.clear()
            self.stop_threads(threads)
            raise
        finally:
            with lock:  # (after SIGTERM/Ctrl-C: no engine takes another task)
                todo.clear()
            bar.close()
        if failures:
            k, i, exc = failures[0]
            raise self._named(k, f"{noun} {i}", exc) from exc
        return results
