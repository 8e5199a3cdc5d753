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
import math
import os
import threading
import time
import warnings

import torch

import common
from agentic_es import checkpoint_noise, engine, fileio, history, placement, stage, tracking, vllm_platform


# after SIGTERM or Ctrl-C, how long the pool waits for its other threads' calls to stop before the engines close (one
# still at work then finds its engine closed: an EngineFailure in that thread, no episode recorded)
POOL_STOP_JOIN_S = 30


class EnginesDisagree(stage.EngineFailure):
    """Two engines of the pool hold different weights after the same updates: their results cannot be mixed."""


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
                                          len(placement.visible_gpus()) if self.device == "cuda" else None)
            if self.device != "cuda":
                placement.check_cpu_pool(pool_size(cfg, self.device), cfg.tensor_parallel_size,
                                         len(os.sched_getaffinity(0)))
        self.size = pool_size(cfg, self.device)
        self.placement = []  # per engine: where it runs (node, GPUs or CPU cores, restore copy)
        try:
            if cfg.ray_address:
                from agentic_es import ray_pool  # imports Ray

                ray_pool.start_engines(self, model_path, engine_kwargs)
                self.device = self.placement[0]["device"]  # the engines' (the driver may have no GPU)
            else:
                self._start_local(model_path, engine_kwargs)
            self.check_same_devices(self._each("rpc", common.ESWorker.es_device))
        except BaseException:
            self.close()
            raise

    # ---- starting and stopping ----
    def check_colocation_per_group(self, engines_per_group: list[int], mps: list[bool]) -> None:
        """The MPS rule for every GPU group, before any engine starts."""
        for count, mps_on in zip(engines_per_group, mps):
            warning = placement.check_colocation(count, self.cfg.tensor_parallel_size, mps_on)
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
                with placement.environment(VLLM_CPU_OMP_THREADS_BIND=placement.cpu_binding(k, tp, cores)):
                    self.engines.append(engine.Engine(self.cfg, model_path, **engine_kwargs))
                self.record_start({"node": "local", "cpu_cores": placement.cpu_binding(k, tp, cores)})
            return
        groups = placement.gpu_groups(placement.visible_gpus(), tp)
        where = placement.place_engines(self.size, len(groups))
        counts = [where.count(j) for j in range(len(groups))]
        mps = placement.mps_running()
        self.check_colocation_per_group(counts, [mps] * len(groups))
        for k, j in enumerate(where):
            with placement.environment(CUDA_VISIBLE_DEVICES=",".join(groups[j])):
                started = placement.start_gpu_engine(self.cfg, model_path, groups[j],
                                                     **placement.engines_to_plan(where, k),
                                                     **engine_kwargs)
            self.engines.append(started)
            self.record_start({"node": "local", "gpus": groups[j], "group": j, "co_located": counts[j],
                           "restore": started.restore_mode, "mps": mps})

    def record_start(self, where: dict) -> None:
        """An engine has started: where it runs, kept (self.placement) and printed."""
        self.placement.append(where)
        shown = ", ".join(f"{k} {v}" for k, v in where.items() if k not in ("pid", "core_pids", "device"))
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
        if self.size == 1 or isinstance(exc, (stage.ConfigError, KeyboardInterrupt)) or str(exc).startswith("engine "):
            return exc
        if isinstance(exc, stage.EngineFailure):
            return stage.EngineFailure(f"{self._name(k)} failed during {what}: {exc}")
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
            raise stage.ConfigError("the engines run on different device models (" + "; ".join(
                f"engine {k}: {history.describe_devices(d)}" for k, d in enumerate(devices)) + "); the noise depends "
                "on the device model, so every engine of a pool must use the same one")

    @property
    def restore_modes(self) -> list[str]:
        """How each engine undoes a perturbation (Engine.restore_mode), in engine order: the run's --restore, except
        where an engine's memory plan held its copy in pinned host memory (copy_host) instead of on the GPU."""
        return [each.restore_mode for each in self.engines]

    def rpc(self, method, **kwargs) -> list:
        """Engine.rpc on engine 0 (a worker method named by reference, common.ESWorker.es_digest)."""
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
