"""The engine pool's engines as Ray actors (--ray_address): one placement group per GPU group on the nodes of a
cluster, an Engine in each actor, and the driver's handle on it (RemoteEngine: Engine's blocking methods, each run in
its actor, the episodes it finishes streamed back as they end). pool.py imports this module, and Ray with it, only
with --ray_address; placement and memory plans are placement.py's, the work queue pool.py's. It does not import
pool.py: start_engines adds each engine it starts to the pool it is handed.
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading

import common
from agentic_es import engine, sandbox, stage
from agentic_es.placement import cpu_binding, engines_to_plan, node_report, place_engines, start_gpu_engine

POOL_POLL_S = 1.0  # how often the driver asks a Ray engine for its finished episodes (progress, on_record)
POOL_START_TIMEOUT_S = 900  # for the cluster to find room for a GPU group's placement group


def start_ray(address: str) -> None:
    """This process joins the Ray cluster at `address` (once)."""
    import ray

    if not ray.is_initialized():  # a caller (a test, a notebook) may have started or joined one already
        ray.init(address=address, include_dashboard=False, log_to_driver=True)


def ray_gpu_groups(tensor_parallel_size: int) -> int:
    """GPU groups of the Ray cluster: on each live node, its GPUs // tensor_parallel_size (no group spans nodes)."""
    import ray

    return sum(int(n["Resources"].get("GPU", 0)) // tensor_parallel_size for n in ray.nodes() if n["Alive"])


def start_engines(pool, model_path: str, engine_kwargs: dict) -> None:
    """The pool's K engines as Ray actors: per GPU group one placement group (its GPUs on one node) holding that
    group's engines; on a CPU cluster one core per engine. Started one after another, each added to the pool as it
    starts (pool.engines, pool.placement_groups), so that the pool's close ends what a failed start left."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    start_ray(pool.cfg.ray_address)
    tp = pool.cfg.tensor_parallel_size
    gpu = ray.cluster_resources().get("GPU", 0) > 0
    groups = ray_gpu_groups(tp) if gpu else pool.size
    where = place_engines(pool.size, min(groups, pool.size))
    counts = [where.count(j) for j in range(max(where) + 1)]
    for j, count in enumerate(counts):
        bundle = {"GPU": tp, "CPU": count} if gpu else {"CPU": count}
        group = placement_group([bundle], strategy="STRICT_PACK", name=f"es-gpu-group-{j}")
        pool.placement_groups.append(group)
        try:
            ray.get(group.ready(), timeout=POOL_START_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise stage.ConfigError(f"the Ray cluster has no room for GPU group {j} ({bundle} on one node); it "
                                    f"has {ray.cluster_resources()}") from None
    strategy = lambda j: PlacementGroupSchedulingStrategy(pool.placement_groups[j],  # noqa: E731
                                                          placement_group_bundle_index=0)
    reports = [ray.get(ray.remote(_probe_node).options(num_cpus=0, num_gpus=tp if gpu else 0,
                                                        scheduling_strategy=strategy(j)).remote(tp))
               for j in range(len(counts))]
    if gpu:
        pool.check_colocation_per_group(counts, [r["mps"] for r in reports])
    path = os.pathsep.join(p for p in (str(common.REPO), os.environ.get("PYTHONPATH", "")) if p)
    leak_check_paths = dict(sandbox.LEAK_CHECK_PATHS) if sandbox.LEAK_CHECK_PATHS else None
    remote = ray.remote(_EngineActor)
    for k, j in enumerate(where):
        env = {"PYTHONPATH": path, "TQDM_DISABLE": "1"}  # the driver draws the progress
        if gpu:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(reports[j]["gpus"])
        if pool.device == "cpu":
            env["VLLM_CPU_OMP_THREADS_BIND"] = cpu_binding(k, tp, reports[j]["cores"])
        same_node = [i for i, g in enumerate(where) if reports[g]["node"] == reports[j]["node"]]
        plan = engines_to_plan([where[i] for i in same_node], same_node.index(k)) if gpu else None
        actor = remote.options(num_cpus=1, num_gpus=0, max_concurrency=2, runtime_env={"env_vars": env},
                               scheduling_strategy=strategy(j)).remote(
            pool.cfg, str(model_path), engine_kwargs, env, leak_check_paths, plan)
        started = RemoteEngine(actor, f"engine {k} of {pool.size}")
        pool.engines.append(started)
        where_k = started.where()  # waits for this engine to be up before the next one starts
        pool.record_start(dict(where_k, group=j, co_located=counts[j], mps=reports[j]["mps"]))


def remove_placement_groups(groups: list) -> None:
    """The pool's placement groups given back to the cluster (also after a failed start)."""
    from ray.util.placement_group import remove_placement_group

    for group in groups:
        with contextlib.suppress(Exception):
            remove_placement_group(group)


class _EngineActor:
    """One Engine inside a Ray actor process (--ray_address). It runs two calls at a time (max_concurrency=2), so
    that poll() answers while a batch of episodes runs."""

    def __init__(self, cfg: common.Config, model_path: str, engine_kwargs: dict, env: dict,
                 leak_check_paths: dict | None, plan: dict | None = None):
        os.environ.update(env)  # the GPUs of its group (Ray sets CUDA_VISIBLE_DEVICES for num_gpus=0 actors)
        self._lock, self._finished = threading.Lock(), []
        self._engine, self._start_error = None, None
        # An exception out of __init__ reaches the driver as an ActorDiedError holding only text: the start's
        # failure (a refusal of this node's sandbox, say) is kept and raised by the first call instead, which Ray
        # hands over as a RayTaskError carrying the exception itself.
        try:
            if leak_check_paths is not None:  # model-written commands run on this node: check its sandbox as well
                common.check_sandbox(cfg, **leak_check_paths)
            # TP stays inside the actor's node: vLLM's multiprocessing workers (it would pick Ray in a placement group)
            executor = "mp" if cfg.tensor_parallel_size > 1 else None
            if plan is None:
                self._engine = engine.Engine(cfg, model_path, executor=executor, **engine_kwargs)
            else:  # a GPU group's engine: its memory plan is made on its node, from what is free when it starts
                gpus = [g for g in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if g]
                self._engine = start_gpu_engine(cfg, model_path, gpus, executor=executor, **plan, **engine_kwargs)
        except Exception as exc:
            self._start_error = exc

    @property
    def engine(self) -> engine.Engine:
        if self._start_error is not None:
            raise self._start_error
        return self._engine

    def _keep(self, record: dict) -> None:
        with self._lock:
            self._finished.append(record)

    def poll(self) -> list[dict]:
        """The episodes finished since the last poll."""
        with self._lock:
            finished, self._finished = self._finished, []
        return finished

    def where(self) -> dict:
        import ray

        return {"pid": os.getpid(), "node": ray.get_runtime_context().get_node_id(),
                "gpus": os.environ.get("CUDA_VISIBLE_DEVICES", ""), "device": self.engine.device,
                "restore": self.engine.restore_mode, "core_pids": self.engine.engine_core_pids()}

    def call(self, method: str, /, *args, **kwargs):
        """The engine's method, for RemoteEngine's blocking calls (rpc, update, digests, ...)."""
        return getattr(self.engine, method)(*args, **kwargs)

    def run_agent(self, jobs: list) -> list[dict]:
        return self.engine.run_agent(jobs, desc=None, on_record=self._keep)

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()


class RemoteEngine:
    """The driver's handle on an engine in a Ray actor: the blocking methods of Engine that the pool calls on its
    engines (and tests and benchmarks on pool.engines[k]), each run in the actor. A lost actor or a failure inside
    it is an EngineFailure."""

    def __init__(self, actor, name: str):
        self.actor, self.name = actor, name
        self.stopping = False  # stop_calls: the driver's waits end (the actor's call ends with its close)

    def _get(self, ref, what: str):
        import ray

        try:
            return ray.get(ref)
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if isinstance(exc.cause, Exception) else exc
            if isinstance(cause, stage.ConfigError):
                raise stage.ConfigError(f"{self.name}: {cause}") from exc
            raise stage.EngineFailure(f"{self.name} failed during {what}: {cause}") from exc
        except ray.exceptions.RayError as exc:  # actor died (process killed, node lost), or unavailable
            # a failed creation task (one _EngineActor does not catch) says what failed: all of it
            detail = str(exc) if getattr(exc, "actor_init_failed", False) else str(exc)[:600]
            raise stage.EngineFailure(f"{self.name} was lost during {what} ({type(exc).__name__}: {detail})") from exc

    def _call(self, method: str, /, *args, **kwargs):
        """engine.method(*args, **kwargs) in the actor, waited for."""
        return self._get(self.actor.call.remote(method, *args, **kwargs), method)

    def rpc(self, method, **kwargs) -> list:
        """Engine.rpc (a worker method named by reference, common.ESWorker.es_digest)."""
        return self._call("rpc", method, **kwargs)

    def parameter_names_sha256(self) -> str:
        return self._call("parameter_names_sha256")

    def perturb(self, seed: int, sigma: float) -> None:
        self._call("perturb", seed, sigma)

    def restore(self) -> None:
        self._call("restore")

    def update(self, seeds: list[int], coeffs: list[float]) -> None:
        self._call("update", seeds, coeffs)

    def digests(self) -> list[str]:
        return self._call("digests")

    def checkpoint_sums(self) -> tuple[dict[str, int], dict[str, list[int]]]:
        return self._call("checkpoint_sums")

    def where(self) -> dict:
        return self._get(self.actor.where.remote(), "start")

    @functools.cached_property
    def restore_mode(self) -> str:
        """Engine.restore_mode in the actor: fixed once the engine started (by its memory plan)."""
        return self.where()["restore"]

    def _streamed(self, ref, what: str, on_record):
        """Wait for a long call, handing the episodes it finishes to on_record as they end."""
        import ray

        while True:
            ready, _ = ray.wait([ref], timeout=POOL_POLL_S)
            for record in self._get(self.actor.poll.remote(), what):
                if on_record is not None:
                    on_record(record)
            if ready:
                return self._get(ref, what)
            if self.stopping:
                raise stage.EngineFailure(f"{self.name}: the stage is stopping; {what} left unfinished")

    def stop_calls(self) -> None:
        """The driver stops waiting on this engine's episodes (the stage is stopping), as Engine.stop_calls."""
        self.stopping = True

    def run_agent(self, jobs, desc=None, on_record=None):
        return self._streamed(self.actor.run_agent.remote(jobs), "episodes", on_record)

    def close(self) -> None:
        import ray

        with contextlib.suppress(Exception):  # a dead engine has nothing left to shut down
            ray.get(self.actor.close.remote(), timeout=stage.ENGINE_SHUTDOWN_S + 30)
        with contextlib.suppress(Exception):
            ray.kill(self.actor)


def _probe_node(gpu_count: int) -> dict:
    """Runs as a Ray task inside a GPU group's placement group: the group's GPUs and its node."""
    import ray

    gpus = [str(g) for g in ray.get_gpu_ids()][:gpu_count]
    return dict(node_report(gpus), node=ray.get_runtime_context().get_node_id())
