"""Where a pool's engines run and whether they fit: GPU groups and the engine -> group placement, CPU core
bindings, the GPU memory plan of each engine (weights, KV cache, where its exact-restore copy or patch goes), the
MPS rule for co-located engines, and what a node has (GPUs' memory, free host memory, MPS, cores). A leaf: pool.py
(the engines in this process) and ray_pool.py (the engines as Ray actors) both import it; it imports neither.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import subprocess
from pathlib import Path

import torch

import common
from agentic_es import engine, restore_patch, stage


GIB = 1 << 30
# memory a GPU engine needs besides vLLM's share (gpu_memory_utilization x GPU memory): its CUDA context, NCCL
# buffers and CUDA graphs (a reserve, not a measurement); and within that share, room for activations
ENGINE_OVERHEAD_BYTES = 1 * GIB
ACTIVATION_RESERVE_BYTES = 2 * GIB
HOST_PINNED_SHARE = 0.8  # exact-restore copies in pinned host memory may take this share of the node's free RAM
MPS_PIPE_DIRECTORY = "/tmp/nvidia-mps"  # nvidia-cuda-mps-control's default when CUDA_MPS_PIPE_DIRECTORY is unset
MPS_COMMANDS = ("export CUDA_MPS_PIPE_DIRECTORY=/tmp/nvidia-mps CUDA_MPS_LOG_DIRECTORY=/tmp/nvidia-mps-log; "
                "mkdir -p $CUDA_MPS_LOG_DIRECTORY; nvidia-cuda-mps-control -d   (as root; stop: echo quit | "
                "nvidia-cuda-mps-control)")




def gpu_groups(gpu_ids: list[str], tensor_parallel_size: int) -> list[list[str]]:
    """A node's GPUs in groups of tensor_parallel_size consecutive ones (a remainder stays unused)."""
    tp = tensor_parallel_size
    return [gpu_ids[j * tp:(j + 1) * tp] for j in range(len(gpu_ids) // tp)]


def place_engines(engines: int, groups: int) -> list[int]:
    """The GPU group of each engine: k mod G, so that engines share GPUs only when there are more than groups."""
    if groups < 1:
        raise stage.ConfigError("no GPU group to place an engine on (fewer GPUs than tensor_parallel_size)")
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
        raise stage.ConfigError(f"engines={engines} x tensor_parallel_size={tensor_parallel_size} = {ranks} TP ranks, "
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
        raise stage.ConfigError(f"cannot size the engines' memory: the model folder has no safetensors weights to "
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
        raise stage.ConfigError(f"cannot size the engines' memory: config.json (model_type "
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
        raise stage.ConfigError(f"an engine's vLLM share does not hold its weights, {gib(ACTIVATION_RESERVE_BYTES)} "
                                f"of activations and one max_model_len sequence ({numbers}): raise "
                                "--gpu_memory_utilization or lower --max_model_len")
    vllm_bytes = engines_per_gpu * (share + ENGINE_OVERHEAD_BYTES)
    if vllm_bytes > gpu_free:
        most = (gpu_free / engines_per_gpu - ENGINE_OVERHEAD_BYTES) / gpu_total
        raise stage.ConfigError(f"{engines_per_gpu} engines per GPU need {gib(vllm_bytes)} ({numbers}, "
                                f"{gib(ENGINE_OVERHEAD_BYTES)} overhead each): use "
                                f"--gpu_memory_utilization={most:.2f} or less, or fewer --engines")
    if restore == "patch" and vllm_bytes + engines_per_gpu * patch_bytes > gpu_free:
        raise stage.ConfigError(f"the restore patches do not fit on the GPUs ({engines_per_gpu} x {gib(patch_bytes)} "
                                f"beside {gib(vllm_bytes)} of vLLM, {gib(gpu_free)} free; a patch is a bit per "
                                "element plus patch_capacity of the weights): lower --patch_capacity or "
                                "--gpu_memory_utilization, use fewer --engines, or --restore=copy_host")
    copies_on_gpu = engines_per_gpu * weights_bytes
    host_copies = engines_on_node * tensor_parallel_size * weights_bytes
    if restore == "copy_device" and vllm_bytes + copies_on_gpu > gpu_free:
        restore = "copy_host"  # as exact; a host-to-device copy per restore instead of a device copy
    if restore == "copy_host" and host_copies > HOST_PINNED_SHARE * host_free:
        raise stage.ConfigError(f"the exact-restore copies fit neither on the GPUs ({engines_per_gpu} x "
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
        raise stage.ConfigError(f"{engines_per_group} engines at tensor_parallel_size={tensor_parallel_size} would "
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
