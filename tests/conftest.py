import contextlib
import hashlib
import os
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
