"""What the test modules share: the engine mark's check (pytest.ini), one worker per module of engines, an offline hub
cache, a Config default edited for one test, waiting for processes to end, acting as another user, and the numbered
scripts run in this process or as subprocesses."""

import contextlib
import hashlib
import importlib
import io
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


ENGINE_MARK = "engine"  # pytest.ini: the tests that start a vLLM engine, left out of the fast loop
_running = {}
# How the suite's two workers share it (pytest.ini: --dist loadfile --no-loadscope-reorder): each takes a whole
# module at a time, so a module's shared engines and runs start once, on one worker; the modules go out in the order
# of collection, which puts the longest first by their seconds below (each module's time in the suite, beside the
# other worker: tests/README.md), then the others in file order: the long ones overlap, and what is left for the end
# is short. (pytest-xdist would otherwise hand out the modules with the most tests first, the long ones last; its
# --dist loadgroup, which could split a module, does not group with pytest 9, whose node ids it cannot extend.) A new
# module of engines belongs here. The modules without engines stay in file order: listed here, they put
# test_sandbox.py (fork bombs) among the first and test_agent_loop.py right after, and the fast loop failed
# test_agent_loop.py's sandboxed commands (bwrap: "Creating new namespace failed: Resource temporarily unavailable").
MODULE_SECONDS = {"test_engine_pool.py": 532, "test_pipeline.py": 515, "test_checkpoint_noise.py": 370,
                  "test_real_model.py": 248, "test_compute_preset.py": 158, "test_presets.py": 152,
                  "test_es_engine.py": 118, "test_speculative.py": 93, "test_scorer_failures.py": 89,
                  "test_old_history.py": 84, "test_agent_engine.py": 41, "test_strict_base_bench.py": 40}


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: -MODULE_SECONDS.get(item.path.name, 0))  # stable: the order within a module stays


_engine_workers = {}  # on pytest-xdist's controller: module -> the workers that ran its tests of the engine mark


def pytest_runtest_logreport(report):
    node = getattr(report, "node", None)  # the worker that ran it: only the controller's reports name one
    if node is not None and report.when == "setup" and ENGINE_MARK in report.keywords:
        _engine_workers.setdefault(report.nodeid.split("::")[0], set()).add(node.gateway.id)


def split_modules(engine_workers) -> list[str]:
    """The modules whose engine tests ran on more than one worker, each with those workers."""
    return [f"{module} ran on {', '.join(sorted(workers))}" for module, workers in sorted(engine_workers.items())
            if len(workers) > 1]


def pytest_sessionfinish(session):
    """A module whose engine tests ran on two workers started its shared engines and runs twice (a scheduler that
    splits modules, as pytest-xdist's loadgroup did under pytest 9): the run fails, naming the modules."""
    split = split_modules(_engine_workers)
    if split:
        session.config.get_terminal_writer().line(
            "modules split over the workers, their shared engines started on each (pytest.ini: --dist loadfile): "
            + "; ".join(split), red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _running["test"] = item  # before its fixtures, which may start the engine it uses


@pytest.fixture(scope="session", autouse=True)
def engines_only_in_marked_tests():
    """An engine started in this process by a test without the `engine` mark (or by a fixture of one) fails it:
    the fast loop, pytest -m "not engine", must start none. (Engines of a subprocess are marked by hand.)"""
    from agentic_es import engine

    start = engine.Engine._start

    async def checked_start(self, vllm_config):
        test = _running.get("test")
        if test is not None and test.get_closest_marker(ENGINE_MARK) is None:
            raise AssertionError(f"{test.nodeid} starts a vLLM engine: mark it @pytest.mark.{ENGINE_MARK}")
        return await start(self, vllm_config)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine.Engine, "_start", checked_start)
        yield


def write_hub_cache(cache, repo_id, folder, revision="0" * 40):
    """Lay out `folder` as the Hugging Face hub cache holds a downloaded repository (no network):
    models--org--name/blobs/<sha256>, snapshots/<revision>/<file> -> ../../blobs/<sha256>, refs/main. Returns the
    snapshot folder."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / revision
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in sorted((p for p in os.scandir(folder) if p.is_file()), key=lambda p: p.name):
        data = open(f.path, "rb").read()
        blob = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / blob).write_bytes(data)
        os.symlink(os.path.join("..", "..", "blobs", blob), snapshot / f.name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(revision)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty, offline Hugging Face hub cache for this test (and the subprocesses it starts)."""
    from huggingface_hub import constants

    cache = tmp_path / "hf-hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


@pytest.fixture
def edit_default(monkeypatch):
    """edit_default(name, value): for this test Config's default of `name` is `value`, as an edit of the default
    beside the field in common.py makes it (the design card's way to start a new run): Config(), the command line's
    defaults and the field's declaration."""
    import dataclasses

    import common

    def edit(name, value):
        names = [f.name for f in dataclasses.fields(common.Config)]
        defaults = list(common.Config.__init__.__defaults__)  # every field has one: one per field, in order
        defaults[names.index(name)] = value
        monkeypatch.setattr(common.Config.__init__, "__defaults__", tuple(defaults))
        monkeypatch.setattr(common.Config.__dataclass_fields__[name], "default", value)
        monkeypatch.setattr(common.Config, name, value)
        assert getattr(common.Config(), name) == value

    return edit


def still_running(processes, timeout=60):
    """(pid, name) of the psutil processes still running (zombies count as ended) after waiting up to `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        alive = []
        for p in processes:
            with contextlib.suppress(psutil.NoSuchProcess):
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p)
        if not alive or time.monotonic() > deadline:
            return [(p.pid, p.name()) for p in alive]
        time.sleep(0.2)


def as_user(uid: int, action) -> str:
    """action() in a forked child that runs as user `uid` (group `uid`, no other groups): what it returns, or the
    error it raises, as text. Needs root."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        try:
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            out = str(action())
        except BaseException as exc:  # noqa: BLE001
            out = f"{type(exc).__name__}: {exc}"
        os.write(write, out.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as pipe:
        out = pipe.read()
    os.waitpid(pid, 0)
    return out


REPO = Path(__file__).resolve().parents[1]
STAGE_NAMES = {"00_data": "data", "01_train": "train", "02_export": "export", "03_eval": "eval", "04_replay": "replay",
               "train_with_test_reward": "train"}


def run_script(script, *args) -> subprocess.CompletedProcess:
    """A numbered script (or tests/train_with_test_reward.py) run as its __main__ block runs it (stage.run_stage:
    main(sys.argv[1:]), a StageError as one line "[name] error: ..." and exit status 1), but in this process, from
    the repository: its exit status and what it printed, as a subprocess.CompletedProcess. For the runs whose
    process is not what is tested (no interpreter start, no second import of torch and vLLM). Left out:
    prepare_script (the process's signal handlers; vLLM's log stays in this process's). os.environ is restored
    afterwards (an engine's set-up writes vLLM's variables into it)."""
    from agentic_es import stage

    module = importlib.import_module(Path(script).stem)
    out, err, saved, status = io.StringIO(), io.StringIO(), dict(os.environ), 0
    try:
        with pytest.MonkeyPatch.context() as patch, contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            patch.setattr(stage, "prepare_script", lambda: None)
            patch.setattr(sys, "argv", [str(script), *map(str, args)])
            patch.chdir(REPO)
            try:
                stage.run_stage(module.main, STAGE_NAMES[Path(script).stem])
            except SystemExit as stop:  # as the interpreter ends on it: a text on stderr and status 1, or a status
                status = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
                if isinstance(stop.code, str):
                    print(stop.code, file=sys.stderr)
    except BaseException:  # a failure of the test, not a refusal: what the stage printed goes with its report
        sys.stdout.write(out.getvalue())
        sys.stderr.write(err.getvalue())
        raise
    finally:
        os.environ.clear()
        os.environ.update(saved)
    return subprocess.CompletedProcess([sys.executable, str(script), *map(str, args)], status, out.getvalue(),
                                       err.getvalue())


@pytest.fixture
def stage(capfd):
    """run_script, with what reached the process's file descriptors 1 and 2 meanwhile (a C library's or a
    logger's) added to its stdout and stderr: for refusals, whose one line must be all the user sees."""
    def run(script, *args) -> subprocess.CompletedProcess:
        capfd.readouterr()
        done = run_script(script, *args)
        out, err = capfd.readouterr()
        return subprocess.CompletedProcess(done.args, done.returncode, out + done.stdout, err + done.stderr)
    return run


def stage_process(script, *args, timeout=300) -> subprocess.CompletedProcess:
    """A numbered script run as its user runs it: a subprocess in the repository (where the process is tested)."""
    return subprocess.run([sys.executable, str(script), *map(str, args)], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)
