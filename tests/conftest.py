import contextlib
import hashlib
import importlib
import os
import subprocess
import sys
import time

import psutil
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


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


STAGE_NAMES = {"01_train.py": "train", "02_export.py": "export", "03_eval.py": "eval", "04_replay.py": "replay"}


@pytest.fixture
def stage(capfd, monkeypatch):
    """stage(script, *args): a numbered script's __main__ block (engine.run_stage: main(sys.argv[1:]), a StageError
    as one line "[name] error: ..." and exit status 1) run in this process, as a subprocess.CompletedProcess: the
    exit status and what the process would have written to stdout and stderr. For refusals and other runs whose
    process is not what is tested: no interpreter start, no second import of torch. prepare_script (the process's
    signal handlers and vLLM's log level) is left out; os.environ is restored after the test."""
    import engine

    monkeypatch.setattr(engine, "prepare_script", lambda: None)
    saved = dict(os.environ)

    def run(script: str, *args) -> subprocess.CompletedProcess:
        script = str(script)
        module = importlib.import_module(os.path.basename(script).removesuffix(".py"))
        monkeypatch.setattr(sys, "argv", [script, *map(str, args)])
        capfd.readouterr()
        status = 0
        try:
            engine.run_stage(module.main, STAGE_NAMES[os.path.basename(script)])
        except SystemExit as stop:  # as the interpreter ends on it: a text on stderr and status 1, or a status
            status = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
            if isinstance(stop.code, str):
                print(stop.code, file=sys.stderr)
        out, err = capfd.readouterr()
        return subprocess.CompletedProcess([sys.executable, script, *map(str, args)], status, out, err)

    yield run
    os.environ.clear()
    os.environ.update(saved)


def stage_process(script: str, *args, timeout=300) -> subprocess.CompletedProcess:
    """A numbered script run as its user runs it: a subprocess in the repository (where the process is tested)."""
    return subprocess.run([sys.executable, str(script), *map(str, args)], cwd=os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), capture_output=True, text=True, timeout=timeout)
