"""Adversarial tests of the bash sandbox (SPEC section 4, "Sandbox"). Every test checks that nothing it started is
left running, found by a unique marker in the process command lines."""

import os
import resource
import shutil
import subprocess
import threading
import time
import uuid

import pytest

import common as A

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KIND = A.sandbox_kind()
NAMESPACED = KIND in ("bwrap", "bwrap-root", "unshare")  # own pid + net namespaces
PRIVATE_FS = KIND in ("bwrap", "bwrap-root")             # host filesystem hidden


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


def orphaned_zombies():
    """Exited processes nobody has reaped yet, other than our own children."""
    zombies = set()
    for name in os.listdir("/proc"):
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] == "Z" and int(fields[1]) != os.getpid():
            zombies.add(int(name))
    return zombies


@pytest.fixture(autouse=True)
def no_orphaned_zombies():
    # a killed sandbox must be reaped by us, not left as a zombie for the host's init (which may never reap it)
    before = orphaned_zombies()
    yield
    deadline = time.monotonic() + 1.0
    while orphaned_zombies() - before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert orphaned_zombies() - before == set()


@pytest.fixture
def workdir():
    path = A.make_workdir()
    yield path
    A.remove_workdir(path)
    assert not os.path.exists(path)


@pytest.fixture
def marker():
    # digits only, so it can also serve as a unique `sleep` duration
    return f"{uuid.uuid4().int % 10**12:012d}"


def test_reports_the_sandbox_kind(workdir):
    result = A.run_bash("echo hello", workdir)
    assert result["stdout"] == "hello\n" and result["exit_code"] == 0 and not result["timed_out"]
    assert result["sandbox"] == KIND in ("bwrap", "bwrap-root", "unshare", "rlimit")
    if shutil.which("bwrap"):
        assert KIND.startswith("bwrap")  # bubblewrap present: it must be what runs


def test_python3_with_the_standard_library(workdir):
    result = A.run_bash("python3 -c 'import math, fractions, itertools; print(math.comb(10, 3))'", workdir)
    assert result["stdout"] == "120\n", result["stderr"]


def test_fork_bomb_is_contained(workdir, marker):
    peak, done = [0], threading.Event()

    def watch():  # sample how many of the bomb's processes exist on the host
        while not done.is_set():
            peak[0] = max(peak[0], len(marked_pids(marker)))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    started = time.monotonic()
    try:
        result = A.run_bash(f":(){{ :|:& }};:; sleep 30; : {marker}", workdir, timeout_s=3)
    finally:
        done.set()
        watcher.join()
    assert result["timed_out"] and time.monotonic() - started < 8
    limit = A.SANDBOX_PROCESSES if KIND == "bwrap" else A.SANDBOX_PROCESSES_ALL
    assert 0 < peak[0] <= limit + 2  # + the two bwrap processes, which carry the command line too
    if KIND == "bwrap":
        assert "Resource temporarily unavailable" in result["stderr"]  # fork() hit RLIMIT_NPROC
    assert_nothing_left(marker)
    assert subprocess.run(["true"]).returncode == 0  # the host can still start processes


def test_process_limit_is_per_sandbox(workdir, marker):
    # the per-sandbox limit must not be shared: two sandboxes each starting 40 processes both succeed
    if KIND != "bwrap":
        pytest.skip("per-sandbox process limit needs the user-namespace bwrap sandbox")
    other = A.make_workdir()
    command = f"for i in $(seq 40); do sleep 2.{marker} & done; wait; echo all-started"
    results = []
    threads = [threading.Thread(target=lambda d=d: results.append(A.run_bash(command, d, timeout_s=10)))
               for d in (workdir, other)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    A.remove_workdir(other)
    assert [r["stdout"] for r in results] == ["all-started\n"] * 2, [r["stderr"][-300:] for r in results]
    assert_nothing_left(marker)


def test_memory_bomb_fails_inside(workdir):
    result = A.run_bash('python3 -c "x = bytearray(10 * 1024**3)"', workdir, timeout_s=10)
    assert result["exit_code"] != 0 and "MemoryError" in result["stderr"]
    assert result["seconds"] < 5


def test_infinite_loop_times_out_fast(workdir, marker):
    result = A.run_bash(f'python3 -c "while True: pass" {marker}', workdir, timeout_s=1.5)
    assert result["timed_out"] and 1.4 < result["seconds"] < 4
    assert_nothing_left(marker)


def test_sleep_is_killed_at_timeout(workdir, marker):
    result = A.run_bash(f"echo before; sleep 3600.{marker}", workdir, timeout_s=1)
    assert result["timed_out"] and result["seconds"] < 3
    assert result["stdout"] == "before\n"  # output written before the kill is kept
    assert "timed out" in A.format_observation(result)
    assert_nothing_left(marker)


@pytest.mark.skipif(not NAMESPACED, reason="escaping the process group is only caught with a pid namespace")
def test_detached_children_are_killed(workdir, marker):
    command = f"setsid sleep 3600.{marker} & nohup sleep 3600.{marker} & (sleep 3600.{marker} &); echo started"
    result = A.run_bash(command, workdir, timeout_s=5)
    assert result["stdout"] == "started\n" and not result["timed_out"]  # returns once the command itself exits
    assert_nothing_left(marker)


def test_huge_output_is_bounded(workdir):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB
    command = "python3 -c \"import sys; sys.stdout.write('H' * 1000 + 'x' * 100_000_000 + 'T' * 1000)\""
    result = A.run_bash(command, workdir, timeout_s=30)
    after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert result["exit_code"] == 0 and not result["timed_out"]
    assert len(result["stdout"]) < A.SANDBOX_OUTPUT_BYTES + 200
    assert result["stdout"].startswith("H" * 1000) and result["stdout"].endswith("T" * 1000)
    assert "bytes of output dropped" in result["stdout"]
    assert after - before < 50 * 1024  # the 100 MB never sat in this process
    observation = A.format_observation(result, 4000)
    assert len(observation) < 4100 and "characters cut" in observation


def test_file_size_limit(workdir):
    result = A.run_bash("head -c 100000000 /dev/zero > big; stat -c %s big", workdir)
    assert int(result["stdout"].split()[-1]) <= A.SANDBOX_FILE_BYTES


@pytest.mark.skipif(not NAMESPACED, reason="no network namespace in this sandbox kind")
def test_no_network(workdir):
    result = A.run_bash(
        "python3 -c \"import socket; socket.create_connection(('1.1.1.1', 53), 2)\"", workdir, timeout_s=10)
    assert result["exit_code"] != 0 and "Error" in result["stderr"] and not result["timed_out"]
    result = A.run_bash("python3 -c \"import socket; print(socket.gethostbyname('pypi.org'))\"", workdir)
    assert result["exit_code"] != 0


@pytest.mark.skipif(not PRIVATE_FS, reason="the host filesystem is visible in this sandbox kind")
def test_host_files_are_invisible(workdir, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("s3cret")
    secret.chmod(0o644)
    data = os.path.abspath(os.path.join(REPO, "..", "shared", "data"))
    assert os.path.exists(os.path.join(data, "aime2026.jsonl"))  # visible to the host, so the check means something
    for path in [os.path.join(data, "aime2026.jsonl"), data, REPO, os.path.join(REPO, "common.py"),
                 "/root", str(secret), workdir]:  # workdir: its host path (it is mounted at SANDBOX_CWD)
        result = A.run_bash(f"ls {path} && cat {path}", workdir)
        assert result["exit_code"] != 0 and "No such file or directory" in result["stderr"], path
        assert "s3cret" not in result["stdout"]


@pytest.mark.skipif(not PRIVATE_FS, reason="the host filesystem is visible in this sandbox kind")
def test_writes_only_in_the_work_dir(workdir):
    for path in ["/usr/evil", "/etc/evil", "/root/evil", "/evil", "/dev/evil", "/bin/evil"]:
        result = A.run_bash(f"echo x > {path}", workdir)
        assert result["exit_code"] != 0, path
        assert not os.path.exists(path)
    result = A.run_bash("echo ok > here.txt && mkdir -p sub && echo deep > sub/f && cat here.txt && pwd", workdir)
    assert result["stdout"] == f"ok\n{A.SANDBOX_CWD}\n"
    with open(os.path.join(workdir, "here.txt")) as f:
        assert f.read() == "ok\n"
    assert A.run_bash("echo t > /tmp/t && cat /tmp/t", workdir)["stdout"] == "t\n"  # private /tmp works


def test_kill_everything_spares_the_host(workdir):
    canaries = [subprocess.Popen(["sleep", "30"])]
    if os.geteuid() == 0 and NAMESPACED:  # even a process of the sandbox's own host uid survives
        canaries.append(subprocess.Popen(["sleep", "30"], user=A.SANDBOX_UID, group=A.SANDBOX_UID, extra_groups=[]))
    try:
        result = A.run_bash("kill -9 -1; sleep 0.2; echo survived", workdir)
        time.sleep(0.2)
        assert all(c.poll() is None for c in canaries)
        assert result["stdout"] == "survived\n"
    finally:
        for c in canaries:
            c.kill()
            c.wait()


def test_environment_is_clean(workdir, monkeypatch):
    monkeypatch.setenv("ES_SECRET_TOKEN", "s3cret")
    result = A.run_bash("env; cat /proc/*/environ 2>/dev/null | tr '\\0' '\\n'", workdir)
    assert "s3cret" not in result["stdout"] + result["stderr"]
    assert "PATH=" in result["stdout"]


def test_remove_workdir_handles_hostile_leftovers(workdir, tmp_path):
    outside = tmp_path / "keep.txt"
    outside.write_text("keep")
    A.run_bash("mkdir -p d/e && touch d/e/f && chmod 000 d/e d && ln -s / rootlink", workdir)
    A.remove_workdir(workdir)
    assert not os.path.exists(workdir) and outside.read_text() == "keep"


# ---- fallbacks ----

def test_fallback_without_bwrap(monkeypatch, workdir):
    real_which = shutil.which
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None if name == "bwrap" else real_which(name, *a, **k))
    kind = A.detect_sandbox()
    assert kind in ("unshare", "rlimit")
    if os.geteuid() == 0 and real_which("unshare") and real_which("setpriv"):
        assert kind == "unshare"
    result = A.run_bash("echo hi; id -u", workdir, sandbox=kind)
    assert result["sandbox"] == kind and result["stdout"].startswith("hi\n")
    if os.geteuid() == 0:
        assert result["stdout"] == f"hi\n{A.SANDBOX_UID}\n"  # never root


def test_forced_mode(monkeypatch):
    monkeypatch.setattr(A, "SANDBOX_MODE", "rlimit")
    assert A.detect_sandbox() == "rlimit"


@pytest.mark.parametrize("kind", ["bwrap", "bwrap-root", "unshare", "rlimit"])
def test_every_kind_runs_limits_and_kills(kind, workdir, marker, monkeypatch):
    needs = {"bwrap": ["bwrap"], "bwrap-root": ["bwrap", "setpriv"], "unshare": ["unshare", "setpriv"], "rlimit": []}
    if any(shutil.which(tool) is None for tool in needs[kind]) or (kind in ("bwrap-root", "unshare")
                                                                    and os.geteuid() != 0):
        pytest.skip(f"{kind} not available here")
    monkeypatch.setenv("ES_SECRET_TOKEN", "s3cret")
    result = A.run_bash("python3 -c 'import fractions; print(fractions.Fraction(1, 3) * 3)'; env; echo x > f; cat f",
                        workdir, sandbox=kind)
    assert result["sandbox"] == kind and result["stdout"].startswith("1\n") and result["stdout"].endswith("x\n")
    assert "s3cret" not in result["stdout"]
    result = A.run_bash('python3 -c "x = bytearray(10 * 1024**3)"', workdir, sandbox=kind)
    assert "MemoryError" in result["stderr"]
    result = A.run_bash(f"sleep 3600.{marker}", workdir, timeout_s=1, sandbox=kind)
    assert result["timed_out"] and result["seconds"] < 3
    assert_nothing_left(marker)
