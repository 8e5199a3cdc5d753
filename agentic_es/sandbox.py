"""The sandbox for model-written commands: every bash command the agent writes runs
here, in a fresh per-episode work directory, without network, with limits on time, memory, CPU, processes and file
size, seeing none of the data, the project, the run folder or the checkpoint; and the start-up leak check that
probes what a command could see.

Namespaces come from bubblewrap when it runs, else (as root) from unshare; without both, only rlimits, which the
leak check refuses unless told otherwise. Standard library only (no torch, no vLLM, no project module): what
depends on a run's settings (its run folder, data and checkpoint, whether leaks are allowed) the caller passes in.

    python agentic_es/sandbox.py  # this machine's sandbox: the kind in use, the leak findings, what python3 imports
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import selectors
import shlex
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]  # the project folder: hidden from every command

BASH_TIMEOUT_S = 20.0                # wall-clock limit of one command run here directly (the stages pass theirs)
SANDBOX_MEMORY_BYTES = 2 * 1024**3   # RLIMIT_AS of every sandboxed process
SANDBOX_FILE_BYTES = 64 * 1024**2    # RLIMIT_FSIZE: largest file a command may write
SANDBOX_TMPFS_BYTES = 64 * 1024**2   # size of the private /tmp and /dev/shm (where bwrap supports --size)
SANDBOX_OPEN_FILES = 256             # RLIMIT_NOFILE
SANDBOX_PROCESSES = 64               # RLIMIT_NPROC inside one sandbox (own user namespace, see run_bash)
SANDBOX_PROCESSES_ALL = 2048         # RLIMIT_NPROC shared by all sandboxes together (same host uid)
SANDBOX_OUTPUT_BYTES = 64 * 1024     # per stream kept from the command: head + rolling tail, the rest counted
SANDBOX_UID = 65534                  # unprivileged host uid ("nobody") the commands run as when we are root
SANDBOX_CWD = "/sandbox"             # where the per-episode work dir appears inside bwrap
SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
SANDBOX_MODE = None                  # None: auto-detect; or force "bwrap", "bwrap-root", "unshare", "rlimit"
WORKDIR_ROOT = None                  # parent of the per-episode work dirs (None: the system temp dir); must be
                                     # searchable by SANDBOX_UID
WORKDIR_PREFIX = "es-agent-"         # a work dir's name: es-agent-<owner>-<random> (owner_marker)
OWNER_ENV = "ES_SANDBOX_OWNER"       # in the environment of every process run_bash starts: its owner_marker
SANDBOX_WORKDIR_BYTES = 256 * 1024**2  # each work dir is a tmpfs of this size when we are root: the disk one
                                       # episode can fill is this + the private /tmp and /dev/shm
SANDBOX_PYTHON_PACKAGES = ("sympy", "mpmath", "numpy")  # bound read-only into the sandbox from the training env
SANDBOX_PYTHONPATH = "/opt/es-python"  # where they appear inside (a neutral path: the project folder stays hidden)

# only these pieces of the host /etc are visible in the sandbox: the dynamic loader cache (Debian keeps libraries
# in /usr/lib/<triplet>) and the alternatives symlinks (awk, ...); no passwd, no hosts, no secrets
SANDBOX_ETC_PATHS = ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/alternatives",
                     "/etc/localtime")

# ---- Sandbox for model-written commands
#
# Kinds, best first (detect_sandbox picks the first that runs `true`):
#   "bwrap"      bubblewrap started as SANDBOX_UID (so its user namespace maps to an unprivileged host uid). Only
#                /usr (read-only), a few /etc files, a private /tmp, /proc, /dev and the work dir exist inside; no
#                network; own pid/ipc/uts namespaces. RLIMIT_NPROC: the kernel counts processes per (user namespace,
#                uid) and checks every ancestor namespace against the limit its creator had, so bwrap is started
#                with SANDBOX_PROCESSES_ALL (the cap on all sandboxes together) and the command itself with
#                SANDBOX_PROCESSES (a fork bomb stops there without starving the other sandboxes).
#                Note: RLIMIT_NPROC never applies to host root, even mapped to another uid inside a user namespace,
#                which is why the host uid must be unprivileged.
#   "bwrap-root" bubblewrap started as root (unprivileged user namespaces disabled); the command drops to
#                SANDBOX_UID with setpriv inside. Same filesystem view; process limit shared by all sandboxes.
#   "unshare"    no bwrap, as root: new mount/net/pid/ipc/uts namespaces; a shell script (_new_root_script) builds
#                the same view as bwrap on a tmpfs (/usr read-only, the /etc pieces, own /proc, a few /dev nodes,
#                private size-limited /tmp and /dev/shm, the work dir at SANDBOX_CWD), pivot_roots into it, drops the
#                old root and setprivs to SANDBOX_UID. Process limit shared by all sandboxes.
#   "rlimit"     only rlimits and SANDBOX_UID (when root): the host filesystem, other episodes and /proc are
#                visible. check_sandbox() refuses to train or evaluate with it unless told to.
# Every kind offers sympy/numpy/mpmath of the training environment read-only at SANDBOX_PYTHONPATH (only the package
# folders: the project and its .venv stay hidden; "rlimit": at their host paths), see sandbox_python_binds().
# Limits per episode: each command's processes get RLIMIT_AS each (memory is bounded per process, not per episode:
# up to SANDBOX_PROCESSES x SANDBOX_MEMORY_BYTES for "bwrap"); the disk one episode can fill is bounded as a whole
# when we are root: the work dir is a tmpfs of SANDBOX_WORKDIR_BYTES, /tmp and /dev/shm tmpfs of SANDBOX_TMPFS_BYTES.
# The command is pid 1 of its own pid namespace (bwrap --as-pid-1, unshare --fork): when it exits or is killed, the
# kernel kills everything else inside, and bwrap/unshare reap it themselves. (bwrap's default extra init process
# is not reaped by bwrap: every call would leave a zombie for the host's init.) In "rlimit" the process group is
# killed instead, which a command can escape with setsid.
#
# A stage killed with SIGKILL (no finally runs) leaves nothing behind either (end_orphaned_sandboxes):
#   - every kind starts with `setpriv --pdeathsig KILL` (_setpriv_argv): the started process (bwrap, unshare, or the
#     command's bash in "rlimit") gets SIGKILL when the thread that started it dies, and with it the pid 1 of its
#     pid namespace (bwrap --die-with-parent, unshare --kill-child, and the setpriv that drops to SANDBOX_UID
#     inside), so the whole namespace; in "rlimit" the command's children outlive it;
#   - every work dir is named es-agent-<owner>-*, owner = this process's pid namespace, pid and start time; every
#     started process carries OWNER_ENV=<owner> in its environment (bwrap clears it inside, the "unshare" script
#     unsets it; in "rlimit" the command's processes inherit it, unless they clear it); inside bwrap or unshare
#     every process's mount namespace has the work dir's tmpfs at SANDBOX_CWD (as root). check_sandbox, at the
#     start of every stage, SIGKILLs the processes so marked whose owner has died, then removes its work dirs
#     (end_orphaned_sandboxes). Needed where the death signal cannot reach: in "bwrap-root" bwrap has dropped
#     CAP_KILL before its child drops to SANDBOX_UID, so the kernel refuses it. Nothing unmarked is ever touched.

@functools.lru_cache(maxsize=None)
def _libc():
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _mount_tmpfs(path, size_bytes, mode, uid):
    """mount(2) a size-limited tmpfs on path (root only). True on success."""
    options = f"size={size_bytes},mode={mode:o},uid={uid},gid={uid}".encode()
    return _libc().mount(b"es-sandbox", os.fsencode(path), b"tmpfs", 0, options) == 0


def make_workdir():
    """A fresh, empty work dir for one episode, writable only by the sandbox user, named after its owner (this
    process: end_orphaned_sandboxes removes it once its owner has died). As root it is a tmpfs of
    SANDBOX_WORKDIR_BYTES, so that all the files of one episode together are bounded."""
    path = tempfile.mkdtemp(prefix=f"{WORKDIR_PREFIX}{owner_marker()}-", dir=WORKDIR_ROOT)
    if os.geteuid() == 0 and not _mount_tmpfs(path, SANDBOX_WORKDIR_BYTES, 0o700, SANDBOX_UID):
        os.chown(path, SANDBOX_UID, SANDBOX_UID)  # no mount allowed (a container): a plain directory
    return path


def remove_workdir(path):
    if os.path.ismount(path):  # a tmpfs work dir: detach it (its memory is freed once nothing uses it)
        _libc().umount2(os.fsencode(path), 2)  # MNT_DETACH
    if os.geteuid() != 0:  # root deletes anything; a normal user must first undo read-only dirs a command left
        for dirpath, dirnames, _ in os.walk(path):
            for name in dirnames:
                sub = os.path.join(dirpath, name)
                if not os.path.islink(sub):  # never follow a link the command planted
                    os.chmod(sub, 0o700)
    shutil.rmtree(path, ignore_errors=True)


# ---- Leftovers of a stage that was killed: the sandboxes' processes and work dirs, found by their owner's marker

def _start_time(pid):
    """A process's start time (clock ticks after boot, field 22 of /proc/<pid>/stat), or None once it is gone: a pid
    is reused, a pid with its start time names one process for good."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _pid_namespace():
    return os.stat("/proc/self/ns/pid").st_ino


def owner_marker():
    """This process as the owner of the sandboxes it starts: "<pid namespace>-<pid>-<start time>"."""
    return f"{_pid_namespace()}-{os.getpid()}-{_start_time(os.getpid())}"


def _owner_died(marker):
    """Whether the process an owner_marker names has ended. One of another pid namespace (a container sharing the
    temp dir) is never judged: its pids mean nothing here."""
    try:
        namespace, pid, start = (int(part) for part in marker.split("-"))
    except ValueError:
        return False
    return namespace == _pid_namespace() and _start_time(pid) != start


def _owner_in_environment(pid):
    """The OWNER_ENV value a process was started with (its environment at exec), or None."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            variables = f.read().split(b"\0")
    except OSError:
        return None
    prefix = f"{OWNER_ENV}=".encode()
    return next((v[len(prefix):].decode(errors="replace") for v in variables if v.startswith(prefix)), None)


def _orphaned_workdirs():
    """The work dirs (make_workdir) whose owner has died: named es-agent-<owner>-<random>, a directory of this user
    (as root: of the sandbox user, who owns its tmpfs), never a link."""
    root = WORKDIR_ROOT or tempfile.gettempdir()
    users = {os.geteuid()} | ({SANDBOX_UID} if os.geteuid() == 0 else set())
    found = []
    for name in sorted(os.listdir(root)):
        match = re.fullmatch(rf"{WORKDIR_PREFIX}(\d+-\d+-\d+)-[a-z0-9_]+", name)
        path = os.path.join(root, name)
        with contextlib.suppress(FileNotFoundError):
            if match and _owner_died(match.group(1)):
                info = os.lstat(path)
                if stat.S_ISDIR(info.st_mode) and info.st_uid in users:
                    found.append(path)
    return found


def _holds_workdir(pid, devices):
    """Whether a process's mount namespace has one of these tmpfs work dirs (major:minor) mounted at SANDBOX_CWD:
    then it runs in a bwrap or unshare sandbox of that work dir. The mount is its own: no command can undo it or
    leave it (no privileges inside), unlike OWNER_ENV, which bwrap clears."""
    try:
        with open(f"/proc/{pid}/mountinfo") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return False
    return any(m[4] == SANDBOX_CWD and m[3] == "/" and m[2] in devices for m in mounts if len(m) > 4)


def _mount_namespace(pid):
    try:
        return os.stat(f"/proc/{pid}/ns/mnt").st_ino
    except OSError:
        return None


def _orphaned_sandbox_process(pid, devices):
    """Whether a process belongs to a sandbox of a dead owner: its OWNER_ENV names a dead owner, or (in another mount
    namespace) it holds one of the dead owners' tmpfs work dirs at SANDBOX_CWD."""
    owner = _owner_in_environment(pid)
    if owner is not None:
        return _owner_died(owner)
    return bool(devices) and _mount_namespace(pid) != _mount_namespace("self") and _holds_workdir(pid, devices)


def _end_orphaned_processes(devices):
    """SIGKILL every process of a dead owner's sandbox (_orphaned_sandbox_process); scans until a scan finds no new
    one (a leftover fork bomb keeps starting them). Returns their pids."""
    ended = set()
    while True:
        found = [int(n) for n in os.listdir("/proc")
                 if n.isdigit() and int(n) not in ended and _orphaned_sandbox_process(n, devices)]
        if not found:
            return sorted(ended)
        for pid in found:
            try:
                pidfd = os.pidfd_open(pid)  # pins the process: the check below and the kill reach the same one
            except OSError:
                continue
            try:
                if _orphaned_sandbox_process(pid, devices):
                    signal.pidfd_send_signal(pidfd, signal.SIGKILL)
                    ended.add(pid)
            except ProcessLookupError:
                pass
            finally:
                os.close(pidfd)


def end_orphaned_sandboxes():
    """What stages that died without cleaning up (SIGKILL) left of their sandboxes: the processes are killed, then
    the work dirs removed, found only by what run_bash and make_workdir marked (OWNER_ENV, the work dir's name,
    the work dir's tmpfs at SANDBOX_CWD); nothing else is ever killed or removed. Returns (pids, paths)."""
    workdirs = _orphaned_workdirs()
    devices = {f"{os.major(d)}:{os.minor(d)}" for d in (os.stat(w).st_dev for w in workdirs if os.path.ismount(w))}
    pids = _end_orphaned_processes(devices)
    for path in workdirs:
        remove_workdir(path)
    return pids, workdirs


def _tool(name):
    """Absolute path of a host tool (bwrap may be unpacked anywhere on PATH; the sandbox's own PATH is fixed)."""
    return shutil.which(name) or name


@functools.lru_cache(maxsize=None)
def _bwrap_supports(option):
    help_text = subprocess.run([_tool("bwrap"), "--help"], capture_output=True, text=True).stdout
    return option in help_text


@functools.lru_cache(maxsize=None)
def _sandbox_python_tag():
    """cache_tag (e.g. "cpython-311") of the python3 that sandboxed commands run, or None."""
    try:
        out = subprocess.run(["python3", "-I", "-c", "import sys; print(sys.implementation.cache_tag)"],
                             env={"PATH": SANDBOX_PATH}, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


@functools.lru_cache(maxsize=None)
def sandbox_python_binds():
    """[(host folder, path inside)] for SANDBOX_PYTHON_PACKAGES (plus bundled native libs such as numpy.libs),
    taken from the environment running this code. When the sandbox's python3 has another ABI, only the
    pure-Python ones (sympy, mpmath); numpy is then whatever that python3 imports itself, if anything."""
    import importlib.util

    same_abi = _sandbox_python_tag() == sys.implementation.cache_tag
    binds = []
    for name in SANDBOX_PYTHON_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            continue
        folder = os.path.realpath(spec.submodule_search_locations[0])
        if not same_abi and any(f.endswith(".so") for _, _, files in os.walk(folder) for f in files):
            continue
        for host in (folder, folder + ".libs"):  # numpy.libs: the wheel's own libopenblas, found via $ORIGIN
            if os.path.isdir(host):
                binds.append((host, f"{SANDBOX_PYTHONPATH}/{os.path.basename(host)}"))
    return tuple(binds)


def _private_tmpfs_argv(path):
    argv = []
    if _bwrap_supports("--perms"):
        argv += ["--perms", "1777"]  # writable after setpriv in "bwrap-root"
    if _bwrap_supports("--size"):
        argv += ["--size", str(SANDBOX_TMPFS_BYTES)]
    return argv + ["--tmpfs", path]


def _bwrap_argv(workdir):
    """bubblewrap options shared by "bwrap" and "bwrap-root": what exists inside and which namespaces are new."""
    argv = [_tool("bwrap"), "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--hostname", "sandbox", "--as-pid-1", "--die-with-parent", "--new-session", "--ro-bind", "/usr", "/usr"]
    for path in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):  # symlinks into /usr on merged-/usr systems
        if os.path.islink(path):
            argv += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            argv += ["--ro-bind", path, path]
    for path in SANDBOX_ETC_PATHS:
        argv += ["--ro-bind-try", path, path]
    argv += ["--proc", "/proc", "--dev", "/dev"]
    argv += _private_tmpfs_argv("/dev/shm") + _private_tmpfs_argv("/tmp")  # /dev/shm: multiprocessing locks
    argv += ["--bind", workdir, SANDBOX_CWD, "--chdir", SANDBOX_CWD]
    if sandbox_python_binds():  # readable parents (bwrap would create them 0700 when started as root)
        argv += [*(["--perms", "0755"] if _bwrap_supports("--perms") else []), "--dir", "/opt",
                 *(["--perms", "0755"] if _bwrap_supports("--perms") else []), "--dir", SANDBOX_PYTHONPATH]
    for host, inside in sandbox_python_binds():
        argv += ["--ro-bind", host, inside]
    # everything else read-only: the sandbox root and /dev are RAM tmpfs that a command could otherwise fill
    argv += ["--remount-ro", "/dev", "--remount-ro", "/", "--clearenv"]
    for name, value in _sandbox_env(SANDBOX_CWD).items():
        argv += ["--setenv", name, value]
    return argv


def _sandbox_env(home, pythonpath=SANDBOX_PYTHONPATH):
    return {"PATH": SANDBOX_PATH, "HOME": home, "TMPDIR": "/tmp", "LANG": "C.UTF-8", "PYTHONDONTWRITEBYTECODE": "1",
            "PYTHONPATH": pythonpath}


@functools.lru_cache(maxsize=None)
def _new_root_script():
    """Shell script for "unshare" (root, fresh mount and pid namespaces, started in the work dir): the bwrap view
    built by hand on a tmpfs mounted over a staging folder (of this mount namespace only), then pivot_root into it.
    The staging folder must not cover what is bound from the host (a venv under /tmp would vanish under a tmpfs on
    /tmp). The work dir is bound from "." (our cwd still reaches it when covered; -c: no path canonicalisation)."""
    q = shlex.quote
    tmpfs = f"-t tmpfs -o mode=1777,size={SANDBOX_TMPFS_BYTES} es-sandbox"
    dirs, files, binds = ["/proc", "/dev/shm", "/tmp", SANDBOX_CWD, "/oldroot"], [], []
    for path in ("/bin", "/sbin", "/lib", "/lib32", "/lib64"):
        if not os.path.islink(path) and os.path.isdir(path):
            dirs.append(path)
            binds.append(path)
    for path in ("/usr", *SANDBOX_ETC_PATHS):
        if os.path.exists(path):
            (dirs if os.path.isdir(path) else files).append(path)
            binds.append(path)
    devices = [f"/dev/{name}" for name in ("null", "zero", "full", "random", "urandom")]
    python = sandbox_python_binds()
    dirs += [inside for _, inside in python]
    sources = [host for host, _ in python] + binds
    stage = next(d for d in ("/mnt", "/srv", "/media", "/tmp") if os.path.isdir(d) and not os.path.islink(d)
                 and not any(src == d or src.startswith(d + "/") for src in sources))
    lines = ["set -eu", "mount --make-rprivate /", f"mount -t tmpfs -o mode=0755,size=1m es-sandbox-root {stage}",
             f"R={stage}", "mkdir -p " + " ".join("$R" + q(d) for d in dict.fromkeys(dirs)),
             "touch " + " ".join("$R" + q(f) for f in files + devices),
             f"mount -c --bind . $R{q(SANDBOX_CWD)}"]
    lines += [f"mount --bind -o ro {q(p)} $R{q(p)}" for p in binds]
    lines += [f"mount --bind -o ro {q(host)} $R{q(inside)}" for host, inside in python]
    lines += [f"mount --bind {d} $R{d}" for d in devices]
    lines += [f"ln -s {q(os.readlink(p))} $R{p}" for p in ("/bin", "/sbin", "/lib", "/lib32", "/lib64")
              if os.path.islink(p)]
    lines += ["for f in fd:self/fd stdin:self/fd/0 stdout:self/fd/1 stderr:self/fd/2; do "
              'ln -s "/proc/${f#*:}" "$R/dev/${f%%:*}"; done',
              f"mount {tmpfs} $R/tmp", f"mount {tmpfs} $R/dev/shm", "mount -t proc proc $R/proc",
              "cd $R", f"{q(_tool('pivot_root'))} . oldroot", "umount -l /oldroot", "rmdir /oldroot",
              "mount -o remount,ro,bind /", f"cd {q(SANDBOX_CWD)}", f"unset OLDPWD {OWNER_ENV}", 'exec "$@"']
    return "\n".join(lines)


def _rlimits_argv(timeout_s, processes):
    """prlimit sets the limits on itself and execs the rest, so nothing runs in Popen's preexec_fn (unsafe with
    threads). CPU seconds per process: a little over the wall clock limit, so a busy loop dies either way."""
    return ["prlimit", f"--as={SANDBOX_MEMORY_BYTES}", f"--cpu={int(timeout_s) + 1}",
            f"--fsize={SANDBOX_FILE_BYTES}", f"--nofile={SANDBOX_OPEN_FILES}", f"--nproc={processes}", "--"]


_SANDBOX_USER = [f"--reuid={SANDBOX_UID}", f"--regid={SANDBOX_UID}", "--clear-groups", "--inh-caps=-all",
                 "--bounding-set=-all", "--no-new-privs"]  # setpriv's options that drop to SANDBOX_UID


@functools.lru_cache(maxsize=None)
def _setpriv_has_pdeathsig():
    if not shutil.which("setpriv"):
        return False
    return "--pdeathsig" in subprocess.run([_tool("setpriv"), "--help"], capture_output=True, text=True).stdout


def _setpriv_argv(as_sandbox_user):
    """setpriv before a sandbox's processes: --pdeathsig KILL ends the process when the thread that started it ends
    (for the started process run_bash's thread, also when the stage is killed; for pid 1 inside "bwrap-root" and
    "unshare" bwrap or unshare), and as_sandbox_user drops to SANDBOX_UID in the same call (a later change of uid
    clears a death signal). Empty where setpriv has no --pdeathsig and there is nothing to drop."""
    options = ["--pdeathsig", "KILL"] if _setpriv_has_pdeathsig() else []
    options += _SANDBOX_USER if as_sandbox_user else []
    return ["setpriv", *options, "--"] if options else []


def _sandbox_argv(kind, command, workdir, timeout_s):
    """(argv, cwd) for one command in the given sandbox kind. When we are root, "bwrap" and "rlimit" start with
    setpriv to SANDBOX_UID (not Popen(user=...), which rules out vfork, and forking this large process is slow)."""
    root = os.geteuid() == 0
    shell = ["bash", "-c", command]
    if kind == "bwrap":
        # the inner prlimit lowers NPROC for this sandbox's own user namespace, see the comment above
        inner = ["prlimit", f"--nproc={SANDBOX_PROCESSES}", "--", *shell]
        argv = [*_bwrap_argv(workdir), "--unshare-user", "--uid", "1000", "--gid", "1000", "--", *inner]
        return _setpriv_argv(root) + _rlimits_argv(timeout_s, SANDBOX_PROCESSES_ALL) + argv, "/"
    if kind == "bwrap-root":
        argv = [*_bwrap_argv(workdir), "--", *_setpriv_argv(True), *shell]
        return _setpriv_argv(False) + _rlimits_argv(timeout_s, SANDBOX_PROCESSES_ALL) + argv, "/"
    if kind == "unshare":
        argv = ["unshare", "--mount", "--net", "--pid", "--ipc", "--uts", "--fork", "--kill-child", "--",
                "bash", "-c", _new_root_script(), "es-sandbox", *_setpriv_argv(True), *shell]
        return _setpriv_argv(False) + _rlimits_argv(timeout_s, SANDBOX_PROCESSES_ALL) + argv, workdir
    if kind == "rlimit":
        return _setpriv_argv(root) + _rlimits_argv(timeout_s, SANDBOX_PROCESSES_ALL) + shell, workdir
    raise ValueError(f"unknown sandbox kind {kind!r}")


class _CappedOutput:
    """Keeps the first and the last `cap // 2` bytes of a stream and counts what falls in between, so a command
    printing 100 MB costs `cap` bytes of memory."""

    def __init__(self, cap):
        self.half, self.head, self.tail, self.total = cap // 2, bytearray(), bytearray(), 0

    def add(self, chunk):
        self.total += len(chunk)
        room = self.half - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        self.tail += chunk
        del self.tail[:max(0, len(self.tail) - self.half)]

    def text(self):
        dropped = self.total - len(self.head) - len(self.tail)
        marker = f"\n[... {dropped} bytes of output dropped ...]\n".encode() if dropped else b""
        return (bytes(self.head) + marker + bytes(self.tail)).decode("utf-8", errors="replace")


def _has_exited(pid):
    """Whether the child has exited, WITHOUT reaping it: while it is unreaped its pid (= our process group id) cannot
    be reused, so a later killpg cannot hit an unrelated process group."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def _children(pid):
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(child) for child in f.read().split()]
    except OSError:
        return []


def _kill_sandbox(proc, kind):
    """SIGKILL everything the command started. Under bwrap/unshare the started process's only child is pid 1 of
    the sandbox's pid namespace: killing it first takes every process inside down with it and lets bwrap/unshare
    reap it and exit (killing bwrap first would orphan it as a zombie). Then the whole process group, for
    "rlimit" and for anything else that is left."""
    if kind != "rlimit" and not _has_exited(proc.pid):
        for child in _children(proc.pid):
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
        # tearing down a pid namespace full of processes (a fork bomb) can take seconds on a loaded machine;
        # killing bwrap/unshare before then would orphan the namespace's pid 1 as a zombie for the host's init
        deadline = time.monotonic() + 10.0
        while not _has_exited(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.005)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _read_ready(selector, outputs, timeout):
    for key, _ in selector.select(timeout=timeout):
        chunk = os.read(key.fd, 65536)
        if chunk:
            outputs[key.fd].add(chunk)
        else:
            selector.unregister(key.fd)


def _collect_output(proc, kind, timeout_s, cap):
    """Read stdout/stderr until the command has exited and both pipes closed, or the deadline passes; then kill
    the sandbox (on timeout, and so that nothing is left behind otherwise). Returns (stdout, stderr, timed_out)."""
    outputs = {proc.stdout.fileno(): _CappedOutput(cap), proc.stderr.fileno(): _CappedOutput(cap)}
    deadline = time.monotonic() + timeout_s
    timed_out, exited_at = False, None
    with selectors.DefaultSelector() as selector:
        for fd in outputs:
            selector.register(fd, selectors.EVENT_READ)
        while True:
            now = time.monotonic()
            if exited_at is None and _has_exited(proc.pid):
                exited_at = now
            if exited_at is not None and (not selector.get_map() or now - exited_at > 0.5):
                break  # done, or a background child still holds the pipes: do not wait for it
            if now >= deadline:
                timed_out = True
                break
            if selector.get_map():
                _read_ready(selector, outputs, timeout=min(deadline - now, 0.1))
            else:  # pipes closed but the command still runs
                time.sleep(min(deadline - now, 0.01))
        _kill_sandbox(proc, kind)
        drain_until = time.monotonic() + 1.0  # what the killed processes wrote before dying
        while selector.get_map() and time.monotonic() < drain_until:
            _read_ready(selector, outputs, timeout=0.1)
    stdout, stderr = (outputs[f.fileno()].text() for f in (proc.stdout, proc.stderr))
    return stdout, stderr, timed_out


def run_bash(command, workdir, timeout_s=BASH_TIMEOUT_S, *, sandbox=None, output_cap_bytes=SANDBOX_OUTPUT_BYTES):
    """Run one model-written shell command in the sandbox (blocking; call it from a worker thread in async code).
    Returns dict(stdout, stderr, exit_code, timed_out, sandbox, seconds, timeout_s); exit_code is negative when a
    signal ended the started process (-9 after a timeout)."""
    kind = sandbox or sandbox_kind()
    argv, cwd = _sandbox_argv(kind, command, workdir, timeout_s)
    if kind == "rlimit":  # no private view: the host's package folders, by their own paths
        env = _sandbox_env(workdir, os.pathsep.join(sorted({os.path.dirname(h) for h, _ in sandbox_python_binds()})))
    else:
        env = _sandbox_env(SANDBOX_CWD)
    env[OWNER_ENV] = owner_marker()  # what end_orphaned_sandboxes finds once this process has died
    started = time.monotonic()
    proc = subprocess.Popen(
        argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, start_new_session=True)  # own process group: one killpg reaches everything
    try:
        stdout, stderr, timed_out = _collect_output(proc, kind, timeout_s, output_cap_bytes)
    finally:
        _kill_sandbox(proc, kind)
        proc.wait()  # reap only now, after the last killpg
        proc.stdout.close()
        proc.stderr.close()
    return {"stdout": stdout, "stderr": stderr, "exit_code": proc.returncode, "timed_out": timed_out,
            "sandbox": kind, "seconds": time.monotonic() - started, "timeout_s": timeout_s}


def detect_sandbox():
    """The strongest sandbox kind that works on this machine (SANDBOX_MODE forces one)."""
    if SANDBOX_MODE is not None:
        return SANDBOX_MODE
    root = os.geteuid() == 0
    candidates = []
    if shutil.which("bwrap"):
        candidates += ["bwrap"] + (["bwrap-root"] if root and shutil.which("setpriv") else [])
    if root and all(shutil.which(tool) for tool in ("unshare", "setpriv", "mount", "pivot_root")):
        candidates.append("unshare")
    workdir = make_workdir()
    try:
        for kind in candidates:
            try:
                if run_bash("true", workdir, timeout_s=10, sandbox=kind)["exit_code"] == 0:
                    return kind
            except OSError:
                continue
    finally:
        remove_workdir(workdir)
    return "rlimit"


@functools.lru_cache(maxsize=None)
def sandbox_kind():
    return detect_sandbox()


# ---- Leak check: what a model-written command could see that it must not

# This process's leak check, made once at start-up by check_sandbox: its result goes into every episode record
# (leak_check_result), the paths it probed to the engines on other nodes, which repeat the check on theirs.
LEAK_CHECK_RESULT = {}  # {kind, leaks, override}: the sandbox kind, its findings, whether they were allowed anyway
LEAK_CHECK_PATHS = {}  # {data, checkpoint}: the files it probed beside the run folder (check_sandbox's arguments)


def leak_check_result() -> dict:
    """What an episode records of its sandbox: the kind its commands run in and this process's leak check,
    {kind, leaks, override}; leaks is None where no check ran in this process."""
    return {"kind": sandbox_kind(), "leaks": None, "override": False, **LEAK_CHECK_RESULT}


def _leak_probe_command(hidden, other_file, host_pid, marker):
    """One shell command that prints a line per finding and "probe-done" at the end."""
    q = shlex.quote
    lines = [f"[ -e {q(path)} ] && echo {q(f'{name}: {path} is visible')}" for name, path in hidden]
    lines += [f"cat {q(other_file)} >/dev/null 2>&1 && echo {q('other_episode: another work dir is readable')}",
              f"grep -aqs {marker} /proc/{host_pid}/cmdline && echo 'host_processes: /proc shows host processes'",
              f"echo x > /tmp/es-leak-{marker} 2>/dev/null", f"echo x > /dev/shm/es-leak-{marker} 2>/dev/null",
              "echo probe-done"]
    return "\n".join(lines)


def sandbox_leaks(kind, hidden=()):
    """A real probe of one sandbox kind: a command in one episode's work dir tries to see each (name, host path)
    of `hidden` (data files, the project, the run folder, ...), read a file in another live episode's work dir,
    find a host process in /proc, and leave files in the host /tmp and /dev/shm. Returns named findings
    ("name: what"), empty when nothing leaks."""
    marker = f"{int.from_bytes(os.urandom(6), 'little'):015d}"
    own, other = make_workdir(), make_workdir()
    host_process = subprocess.Popen(["sleep", f"60.{marker}"])  # a live host process the sandbox must not see
    left_behind = [f"/tmp/es-leak-{marker}", f"/dev/shm/es-leak-{marker}"]
    try:
        other_file = os.path.join(other, "episode-secret")
        with open(other_file, "w") as f:
            f.write("secret")
        os.chmod(other_file, 0o644)  # readable by anyone who can reach it: only the view may stop it
        command = _leak_probe_command(hidden, other_file, host_process.pid, marker)
        result = run_bash(command, own, timeout_s=30, sandbox=kind)
        findings = [line for line in result["stdout"].splitlines() if line != "probe-done"]
        if "probe-done" not in result["stdout"]:
            findings.append(f"probe_failed: exit {result['exit_code']}: {result['stderr'].strip()[-300:]}")
        for path, name in zip(left_behind, ("host_tmp", "host_shm")):
            if os.path.lexists(path):
                findings.append(f"{name}: a file written to {os.path.dirname(path)} reached the host")
                os.remove(path)
        return findings
    finally:
        host_process.kill()
        host_process.wait()
        remove_workdir(own)
        remove_workdir(other)


@contextlib.contextmanager
def _existing_folder(path):
    """The folder, created for the duration if missing (so that probing it means something), removed after."""
    created = [p for p in [path, *path.parents] if not p.exists()]
    path.mkdir(parents=True, exist_ok=True)
    try:
        yield path
    finally:
        for folder in created:  # deepest first; only if still empty
            with contextlib.suppress(OSError):
                folder.rmdir()


def hidden_paths(run_dir, data=(), checkpoint=None):
    """(name, absolute path) pairs no sandboxed command may see: the data files and their folders, the shared
    data folder, the project folder and its Python environment, the run folder and the checkpoint."""
    run_dir = Path(run_dir).resolve()
    pairs = [("project", str(REPO)), ("run_dir", str(run_dir))]
    if sys.prefix != sys.base_prefix:  # a venv (maybe a symlink out of the project); never the system's /usr
        pairs.append(("project", os.path.realpath(sys.prefix)))
    for path in [*data, REPO.parent / "shared" / "data"]:
        if os.path.exists(path):
            path = os.path.realpath(path)
            pairs += [("data", path)] + ([("data", os.path.dirname(path))] if os.path.isfile(path) else [])
    if checkpoint and os.path.exists(checkpoint):
        pairs.append(("checkpoint", os.path.realpath(checkpoint)))
    return list(dict.fromkeys(pairs))


def check_sandbox(run_dir, data=(), checkpoint=None, *, allow_leaks=False, error=ValueError):
    """Start-up check of 01_train.py, 03_eval.py, 04_replay.py and of every engine on another node: end what killed
    stages left of their sandboxes (end_orphaned_sandboxes), then probe the sandbox kind in use against the run's
    folder, data and checkpoint. With findings, refuse (raise `error`: the stages pass stage.ConfigError, which they
    report as a message) unless allow_leaks (--allow_leaky_sandbox); the override and the findings go into every
    episode record (leak_check_result)."""
    pids, workdirs = end_orphaned_sandboxes()
    if pids or workdirs:
        print(f"[sandbox] left by stages that died: {len(pids)} sandbox processes ended, {len(workdirs)} work dirs "
              f"removed ({', '.join(workdirs) or 'none'})")
    kind = sandbox_kind()
    with _existing_folder(Path(run_dir).resolve()):
        leaks = sandbox_leaks(kind, hidden_paths(run_dir, data, checkpoint))
    LEAK_CHECK_RESULT.update(kind=kind, leaks=leaks, override=bool(leaks) and allow_leaks)
    LEAK_CHECK_PATHS.update(data=[str(d) for d in data], checkpoint=checkpoint)
    if leaks and not allow_leaks:
        raise error(f"the {kind!r} sandbox leaks; model-written commands could cheat or interfere:\n  "
                    + "\n  ".join(leaks) + "\nInstall bubblewrap or run as root (see README, The agent), "
                    "or pass --allow_leaky_sandbox=true to run anyway (recorded in every episode record)")
    bound = sorted(os.path.basename(host) for host, _ in sandbox_python_binds())
    python = f"python3 gets {', '.join(bound) or 'none'} of {', '.join(SANDBOX_PYTHON_PACKAGES)} from this env"
    print(f"[sandbox] {kind}: " + (f"{len(leaks)} leaks, ALLOWED by --allow_leaky_sandbox" if leaks else
                                   "leak check clean") + f"; {python}")
    return leaks


def sandbox_report(run_dir=REPO / "runs", data=(REPO / "data",)):
    """What the GPU check prints (`python agentic_es/sandbox.py`): the detected kind, the leak findings and what the sandbox's
    python3 imports. By default it probes the project's runs and data folders; pass a run's own to probe those."""
    kind = sandbox_kind()
    workdir = make_workdir()
    try:
        python = run_bash('python3 -c "import sympy, numpy, mpmath; print(sympy.__version__, numpy.__version__)"',
                          workdir, sandbox=kind)
    finally:
        remove_workdir(workdir)
    with _existing_folder(Path(run_dir).resolve()):
        leaks = sandbox_leaks(kind, hidden_paths(run_dir, data=data))
    return {"kind": kind, "bwrap": shutil.which("bwrap"), "leaks": leaks,
            "python": (python["stdout"] + python["stderr"]).strip()[-300:]}


if __name__ == "__main__":
    print(sandbox_report())
