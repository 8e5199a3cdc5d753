"""Adversarial tests of the bash sandbox, run against every private sandbox kind this
machine can run (bwrap, and the root fallback "unshare"). Every test checks that nothing it started is left
running, found by a unique marker in the process command lines, and that no zombie is left behind."""

import asyncio
import contextlib
import ctypes
import importlib
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import pytest

import common
from agentic_es import actions, history, sandbox, stage

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KIND = sandbox.sandbox_kind()
PRIVATE_KINDS = ("bwrap", "bwrap-root", "unshare")  # own pid/net/mount namespaces; the host filesystem hidden
NEEDS = {"bwrap": ["bwrap"], "bwrap-root": ["bwrap", "setpriv"], "unshare": ["unshare", "setpriv", "pivot_root"],
         "rlimit": []}


def runs_here(kind):
    if any(shutil.which(tool) is None for tool in NEEDS[kind]):
        return False
    if kind in ("bwrap-root", "unshare") and os.geteuid() != 0:
        return False
    workdir = sandbox.make_workdir()
    try:
        return sandbox.run_bash("true", workdir, timeout_s=10, sandbox=kind)["exit_code"] == 0
    finally:
        sandbox.remove_workdir(workdir)


KINDS = [kind for kind in PRIVATE_KINDS if runs_here(kind)]


@pytest.fixture(params=KINDS or [pytest.param(None, marks=pytest.mark.skip(reason="no private sandbox kind here"))])
def kind(request):
    return request.param


def marked_pids(marker):
    """Host pids whose command line contains the marker (our own process excluded)."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    pids.append(int(name))
        except OSError:
            pass
    return pids


def assert_nothing_left(marker, grace_s=3.0):
    deadline = time.monotonic() + grace_s
    while marked_pids(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert marked_pids(marker) == []


def process_state(pid):
    """(state letter, parent pid) from /proc/<pid>/stat, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[1])
    except (OSError, IndexError):
        return None


def orphaned_zombies():
    """Zombies among the processes this test process started: while the module runs, this process is a child
    subreaper (below), so whatever a sandbox orphans is re-parented here instead of to the host's init. Run_bash
    reaps its own child, so a zombie child of ours is one the sandbox left behind. Unrelated processes on the
    machine never count."""
    zombies = set()
    for name in os.listdir("/proc"):
        if name.isdigit() and process_state(name) == ("Z", os.getpid()):
            zombies.add(int(name))
    return zombies


PR_SET_CHILD_SUBREAPER = 36


@pytest.fixture(scope="module", autouse=True)
def subreaper():
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    yield
    libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


@pytest.fixture(autouse=True)
def no_orphaned_zombies(subreaper):
    # a killed sandbox must be reaped by us, not left as a zombie for the host's init (which may never reap it)
    before = orphaned_zombies()
    yield
    deadline = time.monotonic() + 1.0
    while orphaned_zombies() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    left = orphaned_zombies() - before
    for pid in left:  # reap them, so that one failure does not fail the tests after it
        os.waitpid(pid, os.WNOHANG)
    assert left == set()


def test_zombie_check_ignores_unrelated_zombies():
    # a process that never reaps its child: the child stays a zombie of a live parent that is not us (as any
    # unrelated process on the machine may leave); the check must not count it
    parent = subprocess.Popen(["bash", "-c", "sleep 0.3 & exec sleep 5"])
    try:
        deadline = time.monotonic() + 5
        zombie = None
        while zombie is None and time.monotonic() < deadline:
            zombie = next((int(n) for n in os.listdir("/proc")
                           if n.isdigit() and process_state(n) == ("Z", parent.pid)), None)
            time.sleep(0.02)
        assert zombie is not None
        assert zombie not in orphaned_zombies()
    finally:
        parent.kill()
        parent.wait()
        if zombie is not None:  # re-parented to us (the subreaper) when its parent died: reap it
            deadline = time.monotonic() + 5
            while process_state(zombie) is not None and time.monotonic() < deadline:
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(zombie, os.WNOHANG)
                time.sleep(0.02)


@pytest.fixture
def workdir():
    path = sandbox.make_workdir()
    yield path
    sandbox.remove_workdir(path)
    assert not os.path.exists(path)


@pytest.fixture
def marker():
    # digits only, so it can also serve as a unique `sleep` duration
    return f"{uuid.uuid4().int % 10**12:012d}"


def test_reports_the_sandbox_kind(workdir):
    result = sandbox.run_bash("echo hello", workdir)
    assert result["stdout"] == "hello\n" and result["exit_code"] == 0 and not result["timed_out"]
    assert result["sandbox"] == KIND in ("bwrap", "bwrap-root", "unshare", "rlimit")
    if shutil.which("bwrap"):
        assert KIND.startswith("bwrap")  # bubblewrap present: it must be what runs


def test_python3_with_the_standard_library(kind, workdir):
    result = sandbox.run_bash("python3 -c 'import math, fractions, itertools; print(math.comb(10, 3))'", workdir,
                              sandbox=kind)
    assert result["stdout"] == "120\n", result["stderr"]


def test_fork_bomb_is_contained(kind, workdir, marker):
    peak, done = [0], threading.Event()

    def watch():  # sample how many of the bomb's processes exist on the host
        while not done.is_set():
            peak[0] = max(peak[0], len(marked_pids(marker)))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    started = time.monotonic()
    try:
        result = sandbox.run_bash(f":(){{ :|:& }};:; sleep 30; : {marker}", workdir, timeout_s=3, sandbox=kind)
    finally:
        done.set()
        watcher.join()
    assert result["timed_out"] and time.monotonic() - started < 25  # not the bomb's 30 s sleep
    limit = sandbox.SANDBOX_PROCESSES if kind == "bwrap" else sandbox.SANDBOX_PROCESSES_ALL
    assert 0 < peak[0] <= limit + 2  # + the two bwrap processes, which carry the command line too
    if kind == "bwrap":
        assert "Resource temporarily unavailable" in result["stderr"]  # fork() hit RLIMIT_NPROC
    assert_nothing_left(marker)
    assert subprocess.run(["true"]).returncode == 0  # the host can still start processes


def test_process_limit_is_per_sandbox(kind, workdir, marker):
    # the per-sandbox limit must not be shared: two sandboxes each starting 40 processes both succeed
    if kind != "bwrap":
        pytest.skip("per-sandbox process limit needs the user-namespace bwrap sandbox")
    other = sandbox.make_workdir()
    command = f"for i in $(seq 40); do sleep 2.{marker} & done; wait; echo all-started"
    results = []
    threads = [threading.Thread(target=lambda d=d: results.append(sandbox.run_bash(command, d, 10, sandbox=kind)))
               for d in (workdir, other)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sandbox.remove_workdir(other)
    assert [r["stdout"] for r in results] == ["all-started\n"] * 2, [r["stderr"][-300:] for r in results]
    assert_nothing_left(marker)


def test_memory_bomb_fails_inside(kind, workdir):
    result = sandbox.run_bash('python3 -c "x = bytearray(10 * 1024**3)"', workdir, timeout_s=10, sandbox=kind)
    assert result["exit_code"] != 0 and "MemoryError" in result["stderr"]
    assert not result["timed_out"]  # refused at once, not stopped at its 10 s limit


def test_infinite_loop_times_out_fast(kind, workdir, marker):
    result = sandbox.run_bash(f'python3 -c "while True: pass" {marker}', workdir, timeout_s=1.5, sandbox=kind)
    # killed at its limit; the bounds are loose where the machine is loaded (the loop alone would never end)
    assert result["timed_out"] and 1.4 < result["seconds"] < 30
    assert_nothing_left(marker)


def test_sleep_is_killed_at_timeout(kind, workdir, marker):
    result = sandbox.run_bash(f"echo before; sleep 3600.{marker}", workdir, timeout_s=1, sandbox=kind)
    assert result["timed_out"] and result["seconds"] < 60  # not the hour
    assert result["stdout"] == "before\n"  # output written before the kill is kept
    assert "timed out" in actions.format_observation(result, 4000)
    assert_nothing_left(marker)


def test_detached_children_are_killed(kind, workdir, marker):
    command = f"setsid sleep 3600.{marker} & nohup sleep 3600.{marker} & (sleep 3600.{marker} &); echo started"
    result = sandbox.run_bash(command, workdir, timeout_s=5, sandbox=kind)
    assert result["stdout"] == "started\n" and not result["timed_out"]  # returns once the command itself exits
    assert_nothing_left(marker)


def test_huge_output_is_bounded(kind, workdir):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    command = "python3 -c \"import sys; sys.stdout.write('H' * 1000 + 'x' * 100_000_000 + 'T' * 1000)\""
    result = sandbox.run_bash(command, workdir, timeout_s=30, sandbox=kind)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert result["exit_code"] == 0 and not result["timed_out"]
    assert len(result["stdout"]) < sandbox.SANDBOX_OUTPUT_BYTES + 200
    assert result["stdout"].startswith("H" * 1000) and result["stdout"].endswith("T" * 1000)
    assert "bytes of output dropped" in result["stdout"]
    assert after - before < 50 * 1024  # the 100 MB never sat in this process
    observation = actions.format_observation(result, 4000)
    assert len(observation) < 4100 and "characters cut" in observation


def test_file_size_limit(kind, workdir):
    result = sandbox.run_bash("head -c 100000000 /dev/zero > big; stat -c %s big", workdir, sandbox=kind)
    assert int(result["stdout"].split()[-1]) <= sandbox.SANDBOX_FILE_BYTES


def test_no_network(kind, workdir):
    result = sandbox.run_bash(
        "python3 -c \"import socket; socket.create_connection(('1.1.1.1', 53), 2)\"", workdir, 10, sandbox=kind)
    assert result["exit_code"] != 0 and "Error" in result["stderr"] and not result["timed_out"]
    result = sandbox.run_bash("python3 -c \"import socket; print(socket.gethostbyname('pypi.org'))\"", workdir,
                              sandbox=kind)
    assert result["exit_code"] != 0


@pytest.fixture(scope="module")
def data_file():
    """The shared data with the gold answers where this checkout has it (../shared/data), else a stand-in with a
    gold answer in a folder of the project (not under /tmp, which every sandbox replaces anyway)."""
    shared = os.path.abspath(os.path.join(REPO, "..", "shared", "data", "aime2026.jsonl"))
    if os.path.exists(shared):
        yield shared
        return
    folder = tempfile.mkdtemp(prefix=".test-sandbox-data-", dir=REPO)
    path = os.path.join(folder, "gold.jsonl")
    with open(path, "w") as f:
        f.write(json.dumps({"id": "x", "question": "1+1?", "answer": "s3cret"}) + "\n")
    os.chmod(folder, 0o755)
    os.chmod(path, 0o644)
    yield path
    shutil.rmtree(folder)


def test_host_files_are_invisible(kind, workdir, tmp_path, data_file):
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret")
    secret.chmod(0o644)
    data = os.path.dirname(data_file)
    assert os.path.exists(data_file)  # visible to the host, so the check means something
    for path in [data_file, data, REPO, os.path.join(REPO, "common.py"), os.path.realpath(sys.prefix),
                 "/root", str(secret), workdir]:  # workdir: its host path (it is mounted at SANDBOX_CWD)
        result = sandbox.run_bash(f"ls {path} && cat {path}", workdir, sandbox=kind)
        assert result["exit_code"] != 0 and "No such file or directory" in result["stderr"], path
        assert "s3cret" not in result["stdout"]


def test_writes_only_in_the_work_dir(kind, workdir):
    for path in ["/usr/evil", "/etc/evil", "/root/evil", "/evil", "/dev/evil", "/bin/evil"]:
        result = sandbox.run_bash(f"echo x > {path}", workdir, sandbox=kind)
        assert result["exit_code"] != 0, path
        assert not os.path.exists(path)
    result = sandbox.run_bash("echo ok > here.txt && mkdir -p sub && echo deep > sub/f && cat here.txt && pwd",
                              workdir, sandbox=kind)
    assert result["stdout"] == f"ok\n{sandbox.SANDBOX_CWD}\n"
    with open(os.path.join(workdir, "here.txt")) as f:
        assert f.read() == "ok\n"
    # a private /tmp works
    assert sandbox.run_bash("echo t > /tmp/t && cat /tmp/t", workdir, sandbox=kind)["stdout"] == "t\n"


def test_kill_everything_spares_the_host(kind, workdir):
    canaries = [subprocess.Popen(["sleep", "30"])]
    if os.geteuid() == 0:  # even a process of the sandbox's own host uid survives
        canaries.append(subprocess.Popen(["sleep", "30"], user=sandbox.SANDBOX_UID, group=sandbox.SANDBOX_UID,
                                         extra_groups=[]))
    try:
        result = sandbox.run_bash("kill -9 -1; sleep 0.2; echo survived", workdir, sandbox=kind)
        time.sleep(0.2)
        assert all(c.poll() is None for c in canaries)
        assert result["stdout"] == "survived\n"
    finally:
        for c in canaries:
            c.kill()
            c.wait()


def test_environment_is_clean(kind, workdir, monkeypatch):
    monkeypatch.setenv("ES_SECRET_TOKEN", "s3cret")
    result = sandbox.run_bash("env; cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n'", workdir, sandbox=kind)
    assert "s3cret" not in result["stdout"] + result["stderr"]
    assert "PATH=" in result["stdout"]


def test_remove_workdir_handles_hostile_leftovers(kind, workdir, tmp_path):
    outside = tmp_path / "keep.txt"
    outside.write_text("keep")
    sandbox.run_bash("mkdir -p d/e && touch d/e/f && chmod 000 d/e d && ln -s / rootlink", workdir, sandbox=kind)
    sandbox.remove_workdir(workdir)
    assert not os.path.exists(workdir) and outside.read_text() == "keep"


# ---- fallbacks ----

def test_fallback_without_bwrap(monkeypatch, workdir):
    real_which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name == "bwrap" else real_which(name, *a, **k))
    kind = sandbox.detect_sandbox()
    assert kind in ("unshare", "rlimit")
    if os.geteuid() == 0 and all(real_which(tool) for tool in NEEDS["unshare"]):
        assert kind == "unshare"
    result = sandbox.run_bash("echo hi; id -u", workdir, sandbox=kind)
    assert result["sandbox"] == kind and result["stdout"].startswith("hi\n")
    if os.geteuid() == 0:
        assert result["stdout"] == f"hi\n{sandbox.SANDBOX_UID}\n"  # never root


def test_forced_mode(monkeypatch):
    monkeypatch.setattr(sandbox, "SANDBOX_MODE", "rlimit")
    assert sandbox.detect_sandbox() == "rlimit"


@pytest.mark.parametrize("kind", ["bwrap", "bwrap-root", "unshare", "rlimit"])
def test_every_kind_runs_limits_and_kills(kind, workdir, marker, monkeypatch):
    if kind not in KINDS + ["rlimit"]:
        pytest.skip(f"{kind} not available here")
    monkeypatch.setenv("ES_SECRET_TOKEN", "s3cret")
    result = sandbox.run_bash(
        "python3 -c 'import fractions; print(fractions.Fraction(1, 3) * 3)'; env; echo x > f; cat f", workdir,
        sandbox=kind)
    assert result["sandbox"] == kind and result["stdout"].startswith("1\n") and result["stdout"].endswith("x\n")
    result = sandbox.run_bash("python3 -c 'import sympy, numpy, mpmath; print(sympy.Integer(2) ** 100 % 7)'",
                              workdir, sandbox=kind)
    assert result["stdout"] == "2\n", result["stderr"]  # the training env's packages, on every kind
    assert "s3cret" not in result["stdout"]
    result = sandbox.run_bash('python3 -c "x = bytearray(10 * 1024**3)"', workdir, sandbox=kind)
    assert "MemoryError" in result["stderr"]
    result = sandbox.run_bash(f"sleep 3600.{marker}", workdir, timeout_s=1, sandbox=kind)
    assert result["timed_out"] and result["seconds"] < 60  # not the hour
    assert_nothing_left(marker)


# ---- the leak check, the episode's disk, the sandbox's Python, the start-up refusal ----

@pytest.fixture
def hidden(data_file):
    """What no sandboxed command may see, as check_sandbox() builds it, with a run folder in the project."""
    run_dir = os.path.join(REPO, "runs", f"test-sandbox-{uuid.uuid4().hex[:8]}")
    os.makedirs(run_dir)
    yield sandbox.hidden_paths(run_dir, data=[data_file])
    shutil.rmtree(run_dir, ignore_errors=True)


def test_leak_check_is_clean(kind, hidden):
    names = {name for name, _ in hidden}
    assert {"data", "project", "run_dir"} <= names and all(os.path.exists(path) for _, path in hidden)
    assert sandbox.sandbox_leaks(kind, hidden) == []


def test_leak_check_finds_what_rlimit_exposes(hidden, marker):
    leaks = sandbox.sandbox_leaks("rlimit", hidden)
    names = {leak.split(":")[0] for leak in leaks}
    assert {"data", "project", "run_dir", "other_episode", "host_processes", "host_tmp", "host_shm"} <= names, leaks
    assert not [n for folder in ("/tmp", "/dev/shm") for n in os.listdir(folder) if n.startswith("es-leak-")]


def test_nothing_left_behind(kind, marker):
    workdir = sandbox.make_workdir()
    command = (f"echo x > /tmp/left-{marker}; echo x > /dev/shm/left-{marker}; echo x > here-{marker}; "
               f"(sleep 3600.{marker} &); echo done")
    assert sandbox.run_bash(command, workdir, sandbox=kind)["stdout"] == "done\n"
    sandbox.remove_workdir(workdir)
    assert not os.path.exists(workdir)
    assert not [n for folder in ("/tmp", "/dev/shm") for n in os.listdir(folder) if marker in n]
    with open("/proc/self/mountinfo") as f:
        assert workdir not in f.read()  # the work dir's tmpfs is gone too
    assert_nothing_left(marker)


# a stage as the scripts run it: a work dir, then a command in a worker thread (as common.run_episode does)
STAGE = """
import sys, threading
sys.path.insert(0, {repo!r})
from agentic_es import sandbox
workdir = sandbox.make_workdir()
print(workdir, flush=True)
threading.Thread(target=sandbox.run_bash, args=({command!r}, workdir, 600), kwargs={{"sandbox": {kind!r}}}).start()
"""


def start_stage(kind, marker):
    """A real process running a sandboxed command (a sleep in a shell that waits for it); returns it and its work
    dir once the sleep runs."""
    command = f"sleep 3600.{marker}; echo {marker}"
    stage = subprocess.Popen([sys.executable, "-c", STAGE.format(repo=REPO, command=command, kind=kind)],
                             stdout=subprocess.PIPE, text=True)
    workdir = stage.stdout.readline().strip()
    deadline = time.monotonic() + 20
    while not sleeping(marker):
        assert time.monotonic() < deadline and stage.poll() is None, "the sandboxed sleep never started"
        time.sleep(0.05)
    return stage, workdir


def sleeping(marker):
    """Whether `sleep 3600.<marker>` itself runs (not only the shell that starts it)."""
    for pid in marked_pids(marker):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
            if f.read().startswith(b"sleep\0"):
                return True
    return False


def reap_adopted(before):
    """The killed stage's processes are re-parented to this test process (the module's subreaper), not to the host's
    init: reap them as init would, once they have died."""
    for _ in range(5):
        for pid in orphaned_zombies() - before:
            os.waitpid(pid, 0)
        time.sleep(0.05)


def mounted(path):
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == path for line in f)


@pytest.mark.parametrize("kind", ["bwrap", "bwrap-root", "unshare", "rlimit"])
def test_a_stage_killed_with_sigkill_leaves_no_sandbox_behind(kind, marker):
    """SIGKILL runs no clean-up: what can die with the stage does (the setpriv death signal takes bwrap or unshare
    and their pid namespace along); the next start (check_sandbox) ends the rest by its owner's markers (a
    "bwrap-root" sandbox, whose death signal the kernel refuses, and an "rlimit" command's children) and removes the
    work dir and its tmpfs."""
    if kind not in KINDS + ["rlimit"]:
        pytest.skip(f"{kind} not available here")
    zombies = orphaned_zombies()
    stage, workdir = start_stage(kind, marker)
    stage.kill()
    stage.wait()
    stage.stdout.close()
    if kind in ("bwrap", "unshare"):
        assert_nothing_left(marker)  # died with the stage
    assert os.path.isdir(workdir)  # no finally ran
    pids, workdirs = sandbox.end_orphaned_sandboxes()
    assert workdir in workdirs and not os.path.exists(workdir) and not mounted(workdir)
    assert_nothing_left(marker)
    if kind in ("bwrap-root", "rlimit"):
        assert pids  # what the death signal could not reach
    reap_adopted(zombies)


def test_clean_up_touches_only_what_dead_stages_marked(tmp_path, marker):
    """Nothing a live stage runs, nothing unmarked: a sandbox of a live stage, a process and a work dir of a name
    without an owner, a link or a file named like a dead owner's work dir, all survive the clean-up."""
    kind = KINDS[0] if KINDS else "rlimit"
    zombies = orphaned_zombies()
    live, live_workdir = start_stage(kind, marker)
    unmarked = subprocess.Popen(["sleep", f"3600.{marker}"])
    root = tempfile.gettempdir()
    namespace, pid, start = sandbox.owner_marker().split("-")
    dead_owner = f"{namespace}-{pid}-{int(start) + 1}"  # this pid with another start time: a process that has ended
    keep = tmp_path / "keep"
    keep.mkdir()
    planted = {"old": os.path.join(root, f"es-agent-{marker}"),  # no owner in its name
               "link": os.path.join(root, f"es-agent-{dead_owner}-l"),
               "file": os.path.join(root, f"es-agent-{dead_owner}-f")}
    os.mkdir(planted["old"])
    os.symlink(keep, planted["link"])
    open(planted["file"], "w").close()
    try:
        while unmarked.pid not in marked_pids(marker):  # its command line is there once its exec has finished
            time.sleep(0.01)
        before = sorted(marked_pids(marker))
        pids, workdirs = sandbox.end_orphaned_sandboxes()
        assert not set(pids) & set(before) and live_workdir not in workdirs
        assert sorted(marked_pids(marker)) == before and live.poll() is None and unmarked.poll() is None
        assert all(os.path.lexists(path) for path in planted.values()) and keep.is_dir()
    finally:
        for path in planted.values():
            os.rmdir(path) if os.path.isdir(path) and not os.path.islink(path) else os.remove(path)
        unmarked.kill()
        unmarked.wait()
        live.kill()
        live.wait()
        live.stdout.close()
        sandbox.end_orphaned_sandboxes()  # what the killed live stage left: its own test above
    assert_nothing_left(marker)
    reap_adopted(zombies)


@pytest.mark.skipif(os.geteuid() != 0, reason="the work dir is a size-limited tmpfs only when we are root")
def test_episode_disk_is_bounded(kind, workdir):
    # many files under the per-file limit, in the work dir and /tmp: the episode's total stops at the tmpfs sizes
    command = ("for i in 1 2 3 4 5 6; do head -c 60000000 /dev/zero > f$i; done; du -sb . | cut -f1; "
               "for i in 1 2; do head -c 60000000 /dev/zero > /tmp/t$i; done; du -sb /tmp | cut -f1")
    result = sandbox.run_bash(command, workdir, timeout_s=30, sandbox=kind)
    work_bytes, tmp_bytes = map(int, result["stdout"].split())
    assert "No space left on device" in result["stderr"]
    assert 3 * 60000000 < work_bytes <= sandbox.SANDBOX_WORKDIR_BYTES
    assert tmp_bytes <= sandbox.SANDBOX_TMPFS_BYTES


def test_python_has_sympy_numpy_mpmath_only(kind, workdir):
    assert sandbox.sandbox_python_binds(), "the sandbox's python3 and this one differ in ABI: nothing to bind"
    command = ("python3 -c 'import sympy, numpy, mpmath; x = sympy.Symbol(\"x\"); "
               "print(sympy.solve(x**2 - 4, x), int(numpy.linalg.det(numpy.eye(3))), mpmath.mpf(1) / 4)'; "
               f"ls {sandbox.SANDBOX_PYTHONPATH}")
    result = sandbox.run_bash(command, workdir, sandbox=kind)
    lines = result["stdout"].splitlines()
    assert lines[0] == "[-2, 2] 1 0.25", result["stderr"]
    assert set(lines[1:]) == {os.path.basename(host) for host, _ in sandbox.sandbox_python_binds()}
    result = sandbox.run_bash("python3 -c 'import torch'", workdir, sandbox=kind)  # the rest of the venv stays hidden
    assert "No module named 'torch'" in result["stderr"]


def scripted_episode():
    replies = [json.dumps({"name": "bash", "arguments": {"command": "echo 2"}}), "Final answer: \\boxed{2}"]

    async def policy(messages, *, seed, max_tokens):
        return {"text": replies.pop(0), "prompt_tokens": 1, "completion_tokens": 1, "finish_reason": "stop"}

    problem = {"id": "p", "question": "1+1?", "answer": "2"}
    return asyncio.run(common.run_episode(policy, problem, 0, common.Config(),
                                          sandbox_check=sandbox.leak_check_result()))


def test_check_sandbox_refuses_a_leaky_sandbox_unless_allowed(monkeypatch, tmp_path):
    monkeypatch.setattr(sandbox, "LEAK_CHECK_RESULT", {})
    monkeypatch.setattr(sandbox, "sandbox_kind", lambda: "rlimit")
    run_dir = tmp_path / "run"
    with pytest.raises(stage.ConfigError, match="allow_leaky_sandbox") as refused:
        sandbox.check_sandbox(run_dir, error=stage.ConfigError)
    assert "project: " in str(refused.value) and "other_episode: " in str(refused.value)
    with pytest.raises(ValueError, match="allow_leaky_sandbox"):  # the error the caller names, ValueError by default
        sandbox.check_sandbox(run_dir)
    leaks = sandbox.check_sandbox(run_dir, allow_leaks=True, error=stage.ConfigError)
    assert leaks and sandbox.LEAK_CHECK_RESULT == {"kind": "rlimit", "leaks": leaks, "override": True}
    record = scripted_episode()
    assert record["score"] == 1.0 and record["sandbox_override"] is True and record["sandbox_leaks"] == leaks


def test_check_sandbox_passes_a_private_sandbox(kind, monkeypatch, tmp_path):
    monkeypatch.setattr(sandbox, "LEAK_CHECK_RESULT", {})
    monkeypatch.setattr(sandbox, "sandbox_kind", lambda: kind)
    assert sandbox.check_sandbox(tmp_path / "run", error=stage.ConfigError) == []
    assert not (tmp_path / "run").exists()  # made for the probe only
    record = scripted_episode()
    assert record["sandbox"] == kind and record["sandbox_leaks"] == [] and record["sandbox_override"] is False


def test_train_and_eval_refuse_a_leaky_sandbox_before_starting(monkeypatch, tmp_path):
    monkeypatch.setattr(sandbox, "LEAK_CHECK_RESULT", {})
    monkeypatch.setattr(sandbox, "sandbox_kind", lambda: "rlimit")
    train, evaluate = importlib.import_module("01_train"), importlib.import_module("03_eval")
    with pytest.raises(stage.ConfigError, match="leaks"):
        train.main(["--preset=smoke", f"--run_dir={tmp_path / 'train'}"])
    data = tmp_path / "problems.jsonl"
    data.write_text(json.dumps({"id": "a", "question": "1+1?", "answer": "2"}) + "\n")
    with pytest.raises(stage.ConfigError, match="leaks"):
        evaluate.main(["--preset=smoke", "--export=", f"--dapo={data}", f"--aime2026={data}",
                       f"--run_dir={tmp_path / 'eval'}"])
    assert not (tmp_path / "train" / history.HISTORY_FILE).exists() and not (tmp_path / "eval" / "eval-base").exists()


def test_python_of_another_abi_gets_the_pure_python_packages_only(monkeypatch):
    monkeypatch.setattr(sandbox, "_sandbox_python_tag", lambda: "cpython-399")
    bound = {os.path.basename(host) for host, _ in sandbox.sandbox_python_binds.__wrapped__()}
    assert bound == {"sympy", "mpmath"}  # numpy's compiled extensions would not load there


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs a bubblewrap binary to copy")
def test_bwrap_unpacked_elsewhere_on_path_is_detected_and_used(monkeypatch, workdir):
    # like `dpkg -x bubblewrap.deb <dir>` on the GPU image: a bwrap found only through PATH, not in the sandbox's
    folder = tempfile.mkdtemp(prefix="es-unpacked-")
    try:
        os.makedirs(os.path.join(folder, "usr", "bin"))
        unpacked = os.path.join(folder, "usr", "bin", "bwrap")
        shutil.copy2(shutil.which("bwrap"), unpacked)
        for path in (folder, os.path.dirname(os.path.dirname(unpacked)), os.path.dirname(unpacked)):
            os.chmod(path, 0o755)  # reachable by the sandbox user that starts it
        monkeypatch.setenv("PATH", os.path.dirname(unpacked) + os.pathsep + os.environ["PATH"])
        real_which = shutil.which
        monkeypatch.setattr(shutil, "which", lambda name, *a, **k: unpacked if name == "bwrap" else
                            real_which(name, *a, **k))
        sandbox._bwrap_supports.cache_clear()
        kind = sandbox.detect_sandbox()
        assert kind.startswith("bwrap")
        assert unpacked in sandbox._sandbox_argv(kind, "true", workdir, 5)[0]
        assert sandbox.run_bash("echo ok", workdir, sandbox=kind)["stdout"] == "ok\n"
    finally:
        sandbox._bwrap_supports.cache_clear()
        shutil.rmtree(folder)
