"""agentic_es/spawn_imports.py: a spawned process whose target's module is one of PRE_IMPORTED (vLLM's) imports it
with the garbage collector paused, then collects once and freezes what the import kept, before it reads the rest of
the process object; any other spawned process as before. This module stands in for vLLM's (no engine)."""

import gc
import multiprocessing
from multiprocessing import context, reduction

from agentic_es import spawn_imports

GC_ENABLED_AT_IMPORT = gc.isenabled()  # in a child: whether this module was imported with the collector running


def report_to(queue):
    registered = reduction.ForkingPickler._extra_reducers.get(context.SpawnProcess) is spawn_imports._reduce_process
    queue.put({"imported_with_gc": GC_ENABLED_AT_IMPORT, "frozen": gc.get_freeze_count(),
               "gc_enabled": gc.isenabled(), "registered": registered})


def child_report(monkeypatch, pre_imported: tuple) -> dict:
    monkeypatch.setattr(spawn_imports, "PRE_IMPORTED", pre_imported)
    spawn_imports.register()
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    process = ctx.Process(target=report_to, args=(queue,))
    process.start()
    try:
        return queue.get(timeout=120)
    finally:
        process.join(30)


def test_a_target_of_a_pre_imported_module_is_imported_with_the_collector_paused_then_frozen(monkeypatch):
    # this module as vLLM's: the child imports it paused, frees the import's garbage, freezes the rest, runs the
    # collector again, and its own spawns (EngineCore's workers) go the same way
    report = child_report(monkeypatch, (__name__,))
    assert report.pop("frozen") > 0
    assert report == {"imported_with_gc": False, "gc_enabled": True, "registered": True}


def test_any_other_target_is_spawned_as_before(monkeypatch):
    assert child_report(monkeypatch, ("vllm.",)) == {"imported_with_gc": True, "frozen": 0, "gc_enabled": True,
                                                     "registered": False}
