"""Files a run writes and reads: atomic writes (temp file, fsync, rename), JSON read with its shape checked, JSONL
that survives a crash (a torn last line is dropped), the lock files through which the processes of every user of a
machine take turns, the fingerprints of files (a file's sha256, SHA256SUMS beside published files: `sha256sum -c
SHA256SUMS` checks them; the weight files of a model folder), and ClosedOnExit, the `with` of what holds files and
processes open (an engine, a pool, a tracker). The weight digests are in digests.py; an export's manifest in
export.py."""

import contextlib
import functools
import hashlib
import json
import math
import os
import tempfile
from pathlib import Path

from agentic_es import stage



def _fsync_dir(folder):
    """Make a rename durable: the directory entry itself must reach the disk."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_output_path(path, setting: str, folder: bool = True) -> None:
    """Refuse, before any work, an output a stage could not write at the end. `setting` names the option that gave
    the path. Something else in the way is refused: a file where the stage writes a folder, or (folder=False) a
    folder where it writes a file. Then the folder the stage writes in must be a folder it may write in:
      - an output folder that exists: that folder (--run_dir=$HOME needs $HOME writable, not /home);
      - one that does not exist yet: its nearest existing parent, where the stage makes it (--run_dir=runs/a/b
        before runs/ exists: the current folder);
      - an output file, there or not: the folder it goes in, nearest existing (it is written beside, then renamed)."""
    path = Path(path)
    if path.exists() and path.is_dir() != folder:
        raise stage.ConfigError(f"--{setting}={path}: a {'file' if folder else 'folder'} is in the way of the "
                                f"{'folder' if folder else 'file'} this stage writes")
    where = path.absolute()
    writes_in = where if folder and where.is_dir() else next(p for p in where.parents if p.exists())
    if not writes_in.is_dir():
        raise stage.ConfigError(f"--{setting}={path}: {writes_in} is a file, not a folder")
    if not os.access(writes_in, os.W_OK | os.X_OK):
        raise stage.ConfigError(f"--{setting}={path}: no permission to write in {writes_in}")


def open_lock_file(path, name: str, users: str) -> int:
    """A lock file every user of the machine can take turns through: opened read-only (flock needs no write
    access), created readable by all whatever the umask. One another user left unreadable is a ConfigError naming
    the lock (`name`), its owner, who takes turns through it (`users`) and the fix."""
    try:
        try:
            return os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            pass
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:  # another process created it just now
            return os.open(path, os.O_RDONLY)
        os.fchmod(fd, 0o644)  # whatever the umask
        return fd
    except PermissionError as exc:
        try:
            import pwd

            owner = pwd.getpwuid(os.stat(path).st_uid).pw_name
        except (OSError, KeyError):
            owner = "another user"
        raise stage.ConfigError(f"cannot open {name} {path} ({exc.strerror}; it belongs to {owner}): {users} takes "
                                f"turns through it. Make it readable for all (chmod a+r {path}) or remove it, as its "
                                "owner or root") from None


def lock_or_wait(fd: int, waiting: str) -> None:
    """Take the lock of an open lock file; while another process holds it, say so in one line (`waiting`) and
    wait."""
    import fcntl

    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        print(waiting, flush=True)
        fcntl.flock(fd, fcntl.LOCK_EX)


def write_file_atomic(data: str | bytes, path):
    """Text (UTF-8) or bytes into a temp file in the same folder, fsync, rename over path: readers see the old file
    or the new one, never a partial one. Same folder so os.replace is a rename on one filesystem."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, os.stat(path).st_mode & 0o777 if os.path.exists(path) else 0o644)  # mkstemp gives 0600
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    _fsync_dir(folder)


def write_json_atomic(obj, path):
    """Serialise first (a non-JSON value fails before any file is touched), then replace path atomically.
    Strict JSON: NaN/Infinity are refused so every reader can parse the file."""
    text = json.dumps(obj, indent=2, ensure_ascii=False, allow_nan=False) + "\n"
    write_file_atomic(text, path)


def read_json(path, required=None):
    """The JSON in path; with `required` (a shape, see check_shape), refused unless it holds what a stage reads."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except FileNotFoundError:
        raise stage.DataError(f"{path}: file not found") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise stage.DataError(f"{path}: not valid JSON ({e})") from None
    except OSError as e:  # a folder, no permission
        raise stage.DataError(f"{path}: cannot read it ({e.strerror or e})") from None
    check_shape(value, required, path)
    return value


def check_shape(value, shape, path, inside=""):
    """Refuse valid JSON that lacks what a stage reads, with one error naming the file and the key, before any work
    starts. `shape`: None (anything), a tuple of the keys an object must hold, a dict of key -> the shape of its
    value, a one-item list: a list whose every item has that item's shape, or a type: int, float (any finite
    number), str."""
    if shape is None:
        return
    where = f"{path}: {inside}" if inside else f"{path}:"
    if isinstance(shape, type):
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not (isinstance(value, str) if shape is str else number and isinstance(value, int) if shape is int
                else number and (isinstance(value, int) or math.isfinite(value))):
            expected = {int: "an integer", float: "a finite number", str: "a string"}[shape]
            raise stage.DataError(f"{where} expected {expected}, got {json.dumps(value)[:40]}")
        return
    if isinstance(shape, list):
        if not isinstance(value, list):
            raise stage.DataError(f"{where} expected a list, got {type(value).__name__}")
        for i, item in enumerate(value):
            check_shape(item, shape[0], path, f"{inside}[{i}]")
        return
    if not isinstance(value, dict):
        raise stage.DataError(f"{where} expected an object, got {type(value).__name__}")
    for key, inner in (shape if isinstance(shape, dict) else dict.fromkeys(shape)).items():
        if key not in value:
            raise stage.DataError(f"{where} missing key {key!r}")
        check_shape(value[key], inner, path, f"{inside}.{key}" if inside else key)


def _drop_torn_tail(f):
    """f: a file opened 'a+b'. If the last line has no newline (a crash mid-append), complete it when it is
    whole JSON, else cut it off, so the next row does not get glued onto a fragment."""
    f.seek(0, os.SEEK_END)
    size = f.tell()
    if size == 0:
        return
    f.seek(size - 1)
    if f.read(1) == b"\n":
        return
    f.seek(0)
    data = f.read()
    start = data.rfind(b"\n") + 1
    try:
        json.loads(data[start:].decode("utf-8"))
        f.write(b"\n")
    except (json.JSONDecodeError, UnicodeDecodeError):
        f.truncate(start)


def append_jsonl(path, rows):
    """Append rows to a JSONL log, flushed and fsynced so a crash loses at most the row being written."""
    data = b"".join((json.dumps(row, ensure_ascii=False) + "\n").encode("utf-8") for row in rows)
    with open(path, "a+b") as f:  # append mode: every write lands at the end, whatever we read before
        _drop_torn_tail(f)
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def write_jsonl(rows, path):
    """Write rows as JSONL, atomically (a reader never sees half a file)."""
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    write_file_atomic(text, path)


def read_jsonl(path, required=None):
    """Rows of a JSONL log. A last line cut by a crash mid-write is ignored; a bad line anywhere else is
    corruption and an error. With `required` (a shape, see check_shape), every row must have it."""
    try:
        with open(path, "rb") as f:
            lines = f.read().split(b"\n")
    except FileNotFoundError:
        raise stage.DataError(f"{path}: file not found") from None
    except OSError as e:  # a folder, no permission
        raise stage.DataError(f"{path}: cannot read it ({e.strerror or e})") from None
    rows = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line.decode("utf-8")))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            if lineno == len(lines):  # no newline after it: a torn write
                break
            raise stage.DataError(f"{path}:{lineno}: malformed JSON line ({e})") from None
    if required is not None:
        check_shape(rows, [required], path, "row")
    return rows


# ---- The `with` of what holds files and processes open

class ClosedOnExit:
    """`with engine:` closes it on the way out. If the block raised, that error is the one to report, not one
    from closing after it (an engine that failed may not close cleanly)."""

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
            return
        with contextlib.suppress(Exception):
            self.close()


# ---- Fingerprints: a file's sha256, SHA256SUMS beside published files, the weight files of a model folder

SHA256SUMS = "SHA256SUMS"


def sha256_file(path, chunk=1 << 20):
    """Hex sha256 of a file, read in chunks (checkpoint shards are many GB)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _relative_name(folder, file):
    """A file's path relative to folder, with '/' separators, as sha256sum -c expects from inside folder."""
    rel = os.path.relpath(os.path.join(folder, file), folder)
    if rel == os.pardir or rel.startswith(os.pardir + os.sep) or os.path.isabs(rel):
        raise ValueError(f"{file}: not inside {folder}")
    if "\n" in rel or "\\" in rel:
        raise ValueError(f"{file!r}: sha256sum would escape this name; rename it")
    return rel.replace(os.sep, "/")


def write_sha256sums(folder, files, known=None):
    """Write folder/SHA256SUMS in `sha256sum` text format ('<hex>  <name>', sorted by name), so
    `cd folder && sha256sum -c SHA256SUMS` checks the published files. files: paths relative to (or inside)
    folder; known: {name: hex} the caller has just computed (each file is read once). Returns {name: hex}."""
    known = known or {}
    names = sorted({_relative_name(folder, f) for f in files} - {SHA256SUMS})
    sums = {name: known.get(name) or sha256_file(os.path.join(folder, name)) for name in names}
    write_file_atomic("".join(f"{sums[name]}  {name}\n" for name in names), os.path.join(folder, SHA256SUMS))
    return sums


def verify_sha256sums(folder, known=None):
    """Check every file listed in folder/SHA256SUMS. known: {name: hex} the caller has just computed for some of
    them (each file is read once). Returns a list of problems; empty means all match."""
    known = known or {}
    sums_path = os.path.join(folder, SHA256SUMS)
    if not os.path.isfile(sums_path):
        return [f"{sums_path}: missing"]
    problems = []
    try:
        with open(sums_path, "rb") as f:
            lines = f.read().decode("utf-8").splitlines()
    except UnicodeDecodeError as e:
        return [f"{sums_path}: not UTF-8 text ({e.reason} at byte {e.start})"]
    if not any(line.strip() for line in lines):
        problems.append(f"{sums_path}: lists no files")
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        digest, sep, name = line.partition("  ")
        if not sep:
            digest, sep, name = line.partition(" *")  # binary-mode line, also valid sha256sum output
        if not sep or len(digest) != 64 or any(ch not in "0123456789abcdef" for ch in digest.lower()) or not name:
            problems.append(f"{SHA256SUMS}:{lineno}: malformed line {line!r}")
            continue
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            problems.append(f"{name}: missing")
        elif (known.get(name) or sha256_file(path)) != digest.lower():
            problems.append(f"{name}: sha256 mismatch")
    return problems


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def model_fingerprint(model: str) -> str:
    """sha256 over the weight files of a local model folder (name, size, content), so a history can refuse a
    different base. Hub ids are resolved to their local snapshot folder first (models.resolve_model)."""
    folder = Path(model)
    if not folder.is_dir():
        raise stage.ConfigError(f"{model}: not a model folder (models.resolve_model turns a hub id into its local "
                                "snapshot)")
    files = sorted(p for p in folder.iterdir() if p.name.endswith(WEIGHT_SUFFIXES))
    return _weights_fingerprint(tuple((str(f), (st := f.stat()).st_size, st.st_mtime_ns) for f in files))


@functools.lru_cache(maxsize=8)
def _weights_fingerprint(files: tuple) -> str:
    """model_fingerprint of (path, size, mtime) entries: a stage checks the base before its engine starts and again
    in the history's identity, and unchanged files (a 30B checkpoint is ~60 GB) are hashed once."""
    h = hashlib.sha256()
    for path, size, _ in files:
        h.update(f"{Path(path).name}|{size}|{sha256_file(path)}\n".encode())
    return "sha256:" + h.hexdigest()
