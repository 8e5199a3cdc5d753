"""A numbered script as a stage: what it stops with and how it starts and ends. The errors a stage stops with, each
one line for its user (StageError and its kinds, named stage.ConfigError everywhere); a scorer that fails stops
the stage (check_scorer, check_scorer_failures); run_stage, the scripts' __main__ block; SIGTERM and SIGINT raised
as Interrupted; vLLM's log sent to the run folder; and the watchdog that ends vLLM's EngineCore with the script
that started it. Importing this module imports neither torch nor vLLM, so that a stage without an engine
(00_data.py) starts without them.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import signal
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path

from agentic_es import scoring


class StageError(Exception):
    """A stage stops with a message for its user, not a traceback: bad input, another run's files, a vLLM failure.
    The numbered scripts catch this one base class."""


class ConfigError(StageError, ValueError):
    """A setting, a command line or a machine the run cannot use."""


class DataError(StageError, ValueError):
    """A missing, malformed or inconsistent input file or record set."""


class HistoryMismatch(StageError, RuntimeError):
    """A history made by another run, or one whose recorded updates do not rebuild its recorded weights."""


class EngineFailure(StageError, RuntimeError):
    """vLLM itself failed (engine dead, a request errored or was aborted, a worker RPC failed). No episode is at
    fault, so this never becomes a score: it stops the stage, which can then be started again to resume."""


class ScorerFailure(StageError, RuntimeError):
    """The answer scorer's workers cannot start, score known answers wrongly, or failed on too many episodes
    (SCORER_FAILURE_BOUND): the stage stops before it records scores that say nothing of the answers."""


class PatchOverflow(StageError, RuntimeError):
    """restore="patch": a member misses more elements than the patch holds (the weights are back at the centre)."""


class ExportError(StageError, RuntimeError):
    """An export that is not what its manifest says, or weights that differ from the export's."""


class Interrupted(KeyboardInterrupt):
    """SIGTERM (what schedulers send on preemption) or SIGINT arrived; raised in the main thread so that the
    `with Engine(...)` blocks shut vLLM down on the way out."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum
        self.exit_status = 128 + signum  # the shell's convention for "killed by signal signum"


VLLM_LOG = "vllm.log"  # in the run dir: the whole log of vLLM's processes, while the console shows its errors
ENGINE_SHUTDOWN_S = 30  # EngineCore's own teardown, worker grace periods included; then vLLM kills what is left
_vllm_log_to_run_dir = False  # set by prepare_script unless the user chose vLLM's logging (log_vllm_in)


def prepare_script() -> None:
    """Call first in a numbered script's __main__ block. vLLM's log goes to <run_dir>/vllm.log and only its errors
    to the console, which then shows the progress bars, summaries and errors; VLLM_LOGGING_LEVEL or
    VLLM_LOGGING_CONFIG_PATH, when set, choose vLLM's logging instead. SIGTERM and SIGINT raise Interrupted, which
    shuts the engine down."""
    global _vllm_log_to_run_dir
    if not {"VLLM_LOGGING_LEVEL", "VLLM_LOGGING_CONFIG_PATH"} & set(os.environ):
        _vllm_log_to_run_dir = True
        os.environ["VLLM_LOGGING_LEVEL"] = "ERROR"  # until an engine starts and names the file
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")  # torch's C++ notes in the workers (NUMA binding)
    # vLLM's own use of deprecated torch names is nothing the user can act on (here and in the engine's processes)
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm(\.|$)")
    quiet = "ignore::FutureWarning:vllm.triton_utils.dispatcher"
    os.environ["PYTHONWARNINGS"] = ",".join(w for w in (os.environ.get("PYTHONWARNINGS"), quiet) if w)
    if "VLLM_LOGGING_LEVEL" in os.environ:  # this process imported vLLM already; a user's config file sets its own
        logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"].upper())
    stopping = []

    def stop(signum, frame):
        if stopping:  # a second signal while shutting down: let the shutdown finish (vLLM bounds it)
            return
        stopping.append(signum)
        raise Interrupted(signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)


def run_stage(main, name: str) -> None:
    """A numbered script's __main__ block: prepare_script, then main(sys.argv[1:]). A StageError ends the script
    with one line for its user ("[name] error: ..."), a SIGTERM or SIGINT with the shell's status for that signal."""
    prepare_script()
    try:
        main(sys.argv[1:])
    except StageError as exc:
        sys.exit(f"[{name}] error: {exc}")
    except Interrupted as stop:
        sys.exit(stop.exit_status)


def send_vllm_log_to(path: Path) -> None:
    """vLLM's log from INFO up appended to `path` (by this process and the engine's, which read the config named
    in VLLM_LOGGING_CONFIG_PATH when they start), its errors also on the console."""
    import logging.config

    if os.environ.get("ES_VLLM_LOG") == str(path.resolve()):
        return  # another engine of this process writes there already
    path.parent.mkdir(parents=True, exist_ok=True)
    line = "%(processName)s pid=%(process)d %(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"
    config = {
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"line": {"format": line, "datefmt": "%m-%d %H:%M:%S"}},
        "handlers": {
            "file": {"class": "logging.FileHandler", "filename": str(path.resolve()), "formatter": "line"},
            "console": {"class": "logging.StreamHandler", "stream": "ext://sys.stderr", "formatter": "line",
                        "level": "ERROR"}},
        "loggers": {"vllm": {"handlers": ["file", "console"], "level": "INFO", "propagate": False}},
    }
    fd, config_path = tempfile.mkstemp(prefix="es-vllm-logging-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(config, f)
    atexit.register(lambda: Path(config_path).unlink(missing_ok=True))
    os.environ["VLLM_LOGGING_CONFIG_PATH"], os.environ["ES_VLLM_LOG"] = config_path, str(path.resolve())
    os.environ["VLLM_LOGGING_LEVEL"] = "INFO"  # vLLM checks its messages against this before the handlers do
    logging.config.dictConfig(config)


def log_vllm_in(run_dir: str | Path) -> None:
    """vLLM's log to <run_dir>/vllm.log (send_vllm_log_to) where prepare_script chose the run folder for it; nothing
    where the user chose vLLM's logging, or where no script's __main__ block ran (a test, a notebook)."""
    if _vllm_log_to_run_dir:
        send_vllm_log_to(Path(run_dir) / VLLM_LOG)


def _end_engine_core_with_its_parent() -> None:
    """vLLM's TP workers end when EngineCore ends, but EngineCore does not watch the script that started it: after
    a SIGKILL of the script it and its workers keep running (and keep the GPUs). So EngineCore, as this module is
    imported there (the end of the module), asks Linux for a SIGTERM when its parent dies; vLLM's own SIGTERM
    handler then shuts it down."""
    import multiprocessing

    # (the process name is set before the script is imported; multiprocessing.parent_process() only after)
    if not multiprocessing.current_process().name.startswith("EngineCore"):
        return
    parent = os.getppid()
    if not scoring.signal_on_parent_death(signal.SIGTERM, parent):  # the parent died before the request
        os.kill(os.getpid(), signal.SIGTERM)

    def kill_if_orphaned_too_long():
        # vLLM's shutdown after that SIGTERM can hang on a client that is gone (EngineCore waiting on a lock); once
        # the parent is gone, its whole teardown gets ENGINE_SHUTDOWN_S, then SIGKILL (the TP workers end with it)
        while os.getppid() == parent:
            time.sleep(1.0)
        time.sleep(ENGINE_SHUTDOWN_S)
        os.kill(os.getpid(), signal.SIGKILL)

    threading.Thread(target=kill_if_orphaned_too_long, name="es-orphan-watchdog", daemon=True).start()


@contextlib.contextmanager
def vllm_log_dropped():
    """vLLM's log records dropped, never on the console: while a configuration is only checked (the engine's own
    is made again once vLLM's log goes to the run folder)."""
    logger = logging.getLogger("vllm")
    handlers, propagate = logger.handlers[:], logger.propagate
    logger.handlers[:], logger.propagate = [logging.NullHandler()], False
    try:
        yield
    finally:
        logger.handlers[:], logger.propagate = handlers, propagate


# ---- What importing this module does. It runs in every process that imports it: the script's, and vLLM's
# EngineCore and TP workers, which import the script that started them (multiprocessing spawn) before anything else.
# Python's last-resort handler would print vLLM's notes from before vLLM configures its logging (on CPU "Triton is
# installed, but doesn't include CPU backend") bare on the console: a handler that drops them, which vLLM replaces.
logging.getLogger("vllm").addHandler(logging.NullHandler())
_end_engine_core_with_its_parent()  # in EngineCore only: it ends with the script that started it


# ---- A scorer that fails stops the stage (docs/scoring.md): its scores would be 0s that say nothing of the answers

# the score methods of an answer the scorer gave no score for: the machine's failure (an answer that keeps a fresh
# worker busy too is the model's: "answer_timeout", scoring.py); "score_timeout" is how files written before that
# retry recorded a worker's timeout
SCORER_FAILURES = ("score_error", "score_timeout")
SCORER_FAILURE_BOUND = 0.05  # of a generation's (an evaluated set's) episodes; past it the stage stops


def check_scorer() -> None:
    """Before a stage's episodes run: the scorer's workers start and score known answers right (scoring.warm_up),
    else ScorerFailure."""
    try:
        scoring.warm_up()
    except scoring.ScorerBroken as exc:
        raise ScorerFailure(f"the answer scorer does not work, so every answer would score 0: {exc}") from None


def scorer_failures(records: list[dict]) -> dict:
    """{score method: episodes} of SCORER_FAILURES: what a generation or an evaluation records."""
    return {method: sum(r["score_method"] == method for r in records) for method in SCORER_FAILURES}


def check_scorer_failures(records: list[dict], what: str, consequence: str) -> dict:
    """scorer_failures(records), or ScorerFailure when they are more than SCORER_FAILURE_BOUND of the episodes."""
    failures = scorer_failures(records)
    failed = sum(failures.values())
    if failed > SCORER_FAILURE_BOUND * len(records):
        counts = ", ".join(f"{method} {n}" for method, n in failures.items())
        raise ScorerFailure(f"{what}: the scorer failed on {failed} of {len(records)} episodes ({counts}), more "
                                  f"than {SCORER_FAILURE_BOUND:.0%}: {consequence}")
    return failures
