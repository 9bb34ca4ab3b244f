"""Files written safely: atomically (a reader, or a resumed run, never sees a half-written file or
directory), with the permissions any other program would give them, with a one-line error when the disk
is full or read-only, and never over files ciders did not write (output markers, `claim_output`)."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from ciders.errors import CidersError

# ------------------------------------------------------------------------------- storage errors

_STORAGE = {errno.ENOSPC: "disk full", errno.EDQUOT: "disk quota exceeded", errno.EROFS: "read-only file system",
            errno.EACCES: "permission denied", errno.EPERM: "permission denied"}
_OS_ERROR = re.compile(r"os error (\d+)")  # how safetensors (Rust) reports an OSError inside its own exception

from ciders.phases import phase


FULL_OR_READ_ONLY = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EROFS})


def storage_error(exc: BaseException, path: str | os.PathLike, codes=frozenset(_STORAGE)) -> CidersError | None:
    """A one-line error for a write that failed because of the storage (full, read-only, not writable:
    the errno values in `codes`); None for any other failure (a bug, which keeps its traceback)."""
    code = exc.errno if isinstance(exc, OSError) else None
    if code is None and (m := _OS_ERROR.search(str(exc))):
        code = int(m.group(1))
    why = _STORAGE.get(code) if code in codes else None
    if why is None:
        return None
    return CidersError(f"cannot write {path}: {why} ({errno.errorcode.get(code, code)}); what was last committed "
                       "is intact: free space or make the place writable (or choose another --out), then run the "
                       "command again (a run continues with --resume)")


@contextmanager
def writing(path: str | os.PathLike) -> Iterator[None]:
    """Turn a storage failure inside the block into `storage_error`'s one-line CidersError."""
    try:
        yield
    except CidersError:
        raise
    except Exception as exc:
        err = storage_error(exc, path)
        if err is None:
            raise
        raise err from exc


def makedirs(path: str | os.PathLike) -> Path:
    path = Path(path)
    with writing(path):
        path.mkdir(parents=True, exist_ok=True)
    return path


# ------------------------------------------------------------------------------- permissions


def umask() -> int:
    """The process umask, read without changing it where Linux shows it (os.umask can only set it)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def normal_mode(path: Path, directory: bool = False) -> None:
    """mkstemp / mkdtemp create 0600 / 0700 (private scratch); the files ciders publishes get what
    open() / mkdir() would give: 0666 / 0777 less the umask."""
    os.chmod(path, (0o777 if directory else 0o666) & ~umask())


def normal_tree(root: Path) -> None:
    """`normal_mode` for a directory built in scratch and everything in it: writers such as safetensors
    create their files 0600 too (their own temporary file, renamed)."""
    mask = umask()
    for dirpath, _, filenames in os.walk(root):
        os.chmod(dirpath, 0o777 & ~mask)
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), 0o666 & ~mask)


# ------------------------------------------------------------------------------- atomic writes

# the names mkstemp / mkdtemp give the scratch of atomic_path / atomic_dir (8 characters of this alphabet)
LEFTOVER = re.compile(r"^\..+\.[a-z0-9_]{8}\.(tmp|partial)$")


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary sibling path; on success it replaces `path` with os.replace (atomic on POSIX).
    A storage failure is a one-line CidersError and leaves `path` as it was."""
    path = Path(path)
    makedirs(path.parent)
    with writing(path):
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        with writing(path):
            yield tmp_path
            normal_mode(tmp_path)
            os.replace(tmp_path, path)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


@phase("I/O")
def write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def write_json(path: str | os.PathLike, obj: Any) -> None:
    write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


@phase("I/O")
def append_jsonl(path: str | os.PathLike, obj: Any) -> None:
    """Append one JSON line and fsync. A crash (or a full disk) can at worst leave a truncated last line,
    which `read_jsonl` drops."""
    with writing(path), open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(obj) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                break  # torn last line after a crash
    return out


@contextmanager
def atomic_dir(path: str | os.PathLike) -> Iterator[Path]:
    """Build a directory under a temporary name and rename it into place when complete (replacing an
    earlier one: only for directories ciders owns, such as checkpoints/round_N). An interrupted build
    leaves only the temporary directory, which is removed."""
    path = Path(path)
    with _scratch_dir(path) as tmp, writing(path):
        yield tmp
        normal_tree(tmp)
        if path.exists():
            shutil.rmtree(path)
        os.rename(tmp, path)


@contextmanager
def _scratch_dir(path: Path) -> Iterator[Path]:
    """A scratch directory beside `path` (`.NAME.xxxxxxxx.partial`, what resume cleans up), removed on the
    way out unless it was renamed into place."""
    makedirs(path.parent)
    with writing(path):
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent))
    try:
        yield tmp
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def remove_leftovers(root: str | os.PathLike, within: tuple[str, ...] | None = None) -> int:
    """Delete the scratch files and directories that atomic_path / atomic_dir / output_dir leave when the
    process is killed inside them: in `root` itself and, recursively, in its subdirectories named in
    `within` (every one when None). Only names of the scratch pattern are touched. Returns how many."""
    root, n = Path(root), 0
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        for name in [d for d in dirnames if LEFTOVER.match(d)]:
            shutil.rmtree(here / name, ignore_errors=True)
            dirnames.remove(name)
            n += 1
        if here == root and within is not None:
            dirnames[:] = [d for d in dirnames if d in within]
        for name in filenames:
            if LEFTOVER.match(name):
                (here / name).unlink(missing_ok=True)
                n += 1
    return n


# ------------------------------------------------------------------------------- one process per directory

try:
    import fcntl
except ImportError:  # pragma: no cover - not POSIX: no advisory locks, directories are not guarded
    fcntl = None

LOCK_NAME = ".ciders.lock"
_HELD: dict[str, Any] = {}  # realpath of a directory -> the open lock file whose flock this process holds


def acquire_lock(root: str | os.PathLike, what: str = "run directory") -> bool:
    """Hold an exclusive advisory lock (flock) on `root`/.ciders.lock until `release_lock` or the end of the
    process: a second process gets a one-line error naming the holder's pid. The kernel drops the lock
    with its process, so a killed run leaves nothing that blocks a resume. Re-entrant within a process;
    True when this call took the lock (the caller then releases it)."""
    root = makedirs(root)
    key = os.path.realpath(root)
    if key in _HELD or fcntl is None:
        return False
    with writing(root / LOCK_NAME):
        f = open(root / LOCK_NAME, "a+", encoding="ascii")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "?"
        f.close()
        raise CidersError(f"{root} is in use by another process (pid {holder}); wait for it to finish or stop it "
                          f"before starting another on the same {what}") from None
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()}\n")
    f.flush()
    _HELD[key] = f
    return True


def release_lock(root: str | os.PathLike) -> None:
    f = _HELD.pop(os.path.realpath(root), None)
    if f is not None:
        f.close()  # closing the last descriptor of the open file releases the flock


@contextmanager
def locked(root: str | os.PathLike, what: str = "run directory") -> Iterator[None]:
    """`acquire_lock` for the block (released on exit, also by an exception) unless the process held it."""
    took = acquire_lock(root, what)
    try:
        yield
    finally:
        if took:
            release_lock(root)


# ------------------------------------------------------------------------------- output directories

MARKER = ".ciders-output"


# kernel pseudo-filesystems: never a place for files (mkdir fails there; what exists is a kernel setting)
PSEUDO_FS = (Path("/proc"), Path("/sys"))


def check_out_path(path: str | os.PathLike, beside: bool = False) -> None:
    """A one-line error when `path` cannot become a directory ciders writes: a dangling symlink on the way,
    a file where a directory must be, a kernel pseudo-filesystem, a place that is not writable. Cheap, so
    commands call it before any expensive work (an export before it builds the model). `beside`: the
    output is built in a scratch directory beside `path` (`output_dir`), so its parent is written too."""
    path = Path(os.path.abspath(path))
    probe = path  # the nearest component that is there (a symlink counts, even a dangling one)
    while not os.path.lexists(probe):
        probe = probe.parent
    if probe.is_symlink() and not probe.exists():
        raise CidersError(f"{probe} is a symlink to {os.readlink(probe)}, which does not exist (a dangling link); "
                          "create its target directory or choose another --out")
    if probe != path and not probe.is_dir():
        raise CidersError(f"{path} is under {probe}, which is a file, not a directory; choose an --out whose "
                          "parent is a directory")
    real = Path(os.path.realpath(path))
    for fs in PSEUDO_FS:
        if real.is_relative_to(fs):
            raise CidersError(f"{path} is on {fs}, a kernel pseudo-filesystem that holds no files; choose an "
                              "--out on a disk")
    _check_writable(path, probe, beside)


def _check_writable(path: Path, probe: Path, beside: bool) -> None:
    """The directories the command creates entries in: the one that will hold `path` (its nearest existing
    ancestor when it is not there yet) and `path` itself when it exists."""
    dirs = [probe] if probe != path else [path] + ([_existing(path.parent)] if beside else [])
    for d in dirs:
        if d.is_dir() and not os.access(d, os.W_OK | os.X_OK):
            raise CidersError(f"cannot write {d}: permission denied (or a read-only file system); make it "
                              "writable or choose another --out")


def _existing(path: Path) -> Path:
    while not os.path.lexists(path):
        path = path.parent
    return path


def check_output(path: str | os.PathLike, command: str, force: bool = False, legacy: tuple[str, ...] = (),
                 beside: bool = False) -> bool:
    """Whether `path` may be the output directory of `command`, as a one-line error when not: it may be
    absent, empty, an earlier output of the same command (its marker file says so, or, for a directory
    written before markers existed, it holds one of the `legacy` files), or anything with `force`; and it
    must be a place that can be written (`check_out_path`, `beside` as there).
    Writes nothing; True when `path` is already the command's own."""
    check_out_path(path, beside)
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise CidersError(f"{path} is a file; --out must name a directory")
    owner = output_owner(path)
    ours = owner == command or (owner is None and any((path / f).exists() for f in legacy))
    if not ours and not force and path.is_dir() and any(path.iterdir()):
        what = f"is the output of `ciders {owner}`" if owner else "holds files ciders did not write"
        raise CidersError(f"{path} {what}; choose another --out (an empty or new directory), or pass --force "
                          "to write into it anyway (files with the names ciders writes are replaced)")
    return ours


def claim_output(path: str | os.PathLike, command: str, force: bool = False, legacy: tuple[str, ...] = ()) -> Path:
    """`check_output`, then make `path` the command's: created, with a marker naming the command, written at
    once so that an interrupted command's directory is recognised as its own next time."""
    path = Path(path)
    check_output(path, command, force, legacy)
    makedirs(path)
    if output_owner(path) != command:
        write_json(path / MARKER, {"command": command})
    return path


def output_owner(path: str | os.PathLike) -> str | None:
    """The command whose marker `path` holds, or None (no marker, or an unreadable one)."""
    try:
        return str(json.loads((Path(path) / MARKER).read_text(encoding="utf-8"))["command"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


@contextmanager
def output_dir(path: str | os.PathLike, command: str) -> Iterator[Path]:
    """Build the output directory of `command` under a scratch name beside `path`, then put it in place:
    renamed whole when `path` does not exist yet, else file by file (each os.replace atomic), deleting
    only the files that the earlier output of `command` listed in its marker and this one no longer
    writes. Files ciders did not write are never deleted; the marker, written last, lists the files."""
    path = Path(path)
    with _scratch_dir(path) as tmp, writing(path):
        yield tmp
        normal_tree(tmp)
        new = sorted(p.relative_to(tmp).as_posix() for p in tmp.rglob("*") if p.is_file() and p.name != MARKER)
        if not path.exists():
            (tmp / MARKER).write_text(json.dumps({"command": command, "files": new}) + "\n", encoding="utf-8")
            os.rename(tmp, path)
            return
        _merge(tmp, path, command, new)


def _merge(tmp: Path, path: Path, command: str, new: list[str]) -> None:
    old: set[str] = set()
    if output_owner(path) == command:
        listed = json.loads((path / MARKER).read_text(encoding="utf-8")).get("files", [])
        old = {f for f in listed if isinstance(f, str)}
    for rel in new:  # all checked before the first file moves: a refused export leaves `path` as it was
        _check_target(path, rel)
    for rel in new:
        makedirs((path / rel).parent)
        os.replace(tmp / rel, path / rel)
    for rel in sorted(old - set(new)):
        target = path / rel
        # a listed name that leads outside `path` (a symlinked directory, `..`) or to a directory is skipped:
        # the marker is a file anyone could edit, and only the output's own files may go
        if _inside(path, rel) and (target.is_symlink() or target.is_file()):
            target.unlink(missing_ok=True)  # a symlink itself is removed, never what it points to
    write_json(path / MARKER, {"command": command, "files": new})


def _inside(path: Path, rel: str) -> bool:
    """Whether `path`/`rel` names an entry of the directory `path` itself: a relative name without `..`
    whose directories resolve to where they stand, i.e. are not symlinks. Through a symlinked directory a
    write or a delete would land outside the output (or on another of its files)."""
    r = Path(rel)
    if r.is_absolute() or ".." in r.parts:
        return False
    return os.path.realpath(path / r.parent) == os.path.join(os.path.realpath(path), *r.parent.parts)


def _check_target(path: Path, rel: str) -> None:
    target = path / rel
    if not _inside(path, rel):
        raise CidersError(f"{target.parent} is reached through a symlinked directory (it leads to "
                          f"{os.path.realpath(target.parent)}); ciders writes only into the real directories of "
                          f"{path}: replace the link by a directory, or choose another --out")
    if target.is_dir() and not target.is_symlink():
        raise CidersError(f"{target} is a directory where ciders writes a file; move it away or choose another "
                          "--out")
