"""Atomic file writes and hashing shared by the exporter, the engine builder and the deployers.

One file: :func:`write_atomic` writes a temporary name in the destination folder, flushes, then
moves it over the destination with ``os.replace``: readers see the old file or the complete new
one.

A group of files (a model and its sidecar, an engine and its sidecar): :func:`staged_outputs`
writes everything into one hidden staging folder next to the targets
(``.qkrope-staging-<pid>-<process start>-<random>``), then :meth:`Staging.commit` moves the files
into place in the order given, keeping a hard link to each old file so that any failure during
the commit puts the old group back. Nothing outside the staging folder changes before the commit,
so a failure while writing (a full disk, a read-only folder, a target that is a directory) leaves
the old group intact. SIGTERM/SIGHUP during the staged block remove the staging folder and exit
143/129 (a signal during the commit is held until the commit is done); a SIGKILL cannot be
handled, so every :func:`staged_outputs` first removes the staging folders of processes that are
gone. Writers order the commit so that a kill between two renames leaves a state the readers
detect (the ONNX sidecar records the sha256 of its model: the sidecar moves first, the model
last). OS errors become :class:`OutputWriteError`, one line naming the path and the fix.

Concurrent writers of one folder: every commit holds an advisory lock on the target folder
(``flock`` on the folder itself, :func:`folder_lock`), so two writers of one group commit one after
the other and the group is always one writer's complete result (each pair also records the hash of
its large file: a mismatched pair is refused by the readers).

Before any work, the writers check their outputs (:func:`check_outputs`): an output that is one of
the command's inputs or their sidecars (same file after symlinks, or a hard link) is refused, and
so is an existing file that recognisably is something else than what is written there
(:func:`file_kind`: an ONNX model where an engine or a timing cache goes, a sidecar of the other
kind, a JSON or text file where a binary goes): it is not replaced.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterator, Sequence

from qkrope.errors import QkropeError

STAGING_PREFIX = ".qkrope-staging-"
_STAGING_RE = re.compile(re.escape(STAGING_PREFIX) + r"(\d+)-(\d+)-[0-9A-Za-z_]+$")
_ACTIVE: set[str] = set()  # staging folders of this process in use
_COMMITTING = threading.local()
_PENDING_SIGNALS: list[int] = []


class OutputWriteError(QkropeError, OSError):
    """An output could not be written (read-only folder, full disk, a path component that is a
    file, a target that is a directory); the message names the path and the fix."""


def _umask() -> int:
    """The process umask, read without changing it where Linux exposes it (os.umask alone must
    set it to read it, which races with other threads creating files)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_atomic(path: str | os.PathLike, data: bytes | bytearray | memoryview) -> None:
    """Write ``data`` to ``path`` atomically (temp file, fsync, rename), with the permissions a
    plain ``open(path, "wb")`` would give (``mkstemp`` alone creates 0600)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(memoryview(data))
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    write_atomic(path, text.encode("utf-8"))


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    write_text_atomic(path, json.dumps(obj, indent=2) + "\n")


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------

def output_error(exc: OSError, path: str | os.PathLike, *, flag: str = "--out") -> OutputWriteError:
    """An OSError while writing ``path`` as one line with the fix (by errno)."""
    if isinstance(exc, OutputWriteError):
        return exc
    code = exc.errno
    where = exc.filename if exc.filename else path
    reason = exc.strerror or str(exc)
    if code in (errno.ENOSPC, errno.EDQUOT):
        fix = f"the disk is full: free space on the disk of {path} or choose another {flag}"
    elif code in (errno.EACCES, errno.EPERM, errno.EROFS):
        fix = f"the folder is not writable: choose a writable folder with {flag}"
    elif code in (errno.ENOTDIR, errno.EEXIST):
        fix = f"a component of the path is a file, not a folder: choose another {flag}"
    elif code == errno.EISDIR:
        fix = f"the target is a directory: remove it or choose another {flag}"
    else:
        fix = f"check the folder of {path} or choose another {flag}"
    return OutputWriteError(code, f"cannot write {path} ({where}: {reason}); {fix}")


def check_output_folder(folder: str | os.PathLike, *, flag: str = "--out") -> Path:
    """Fail fast, before any expensive work, when outputs cannot go into ``folder``: a path
    component that is a file, or an existing folder that is not writable."""
    folder = Path(folder)
    probe = folder
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if probe.exists() and not probe.is_dir():
        raise OutputWriteError(errno.ENOTDIR, f"cannot write into {folder}: {probe} is a file, "
                                              f"not a folder; choose another {flag}")
    if probe.is_dir() and not os.access(probe, os.W_OK | os.X_OK):
        raise OutputWriteError(errno.EACCES, f"cannot write into {folder}: {probe} is not "
                                             f"writable; choose a writable folder with {flag}")
    return folder


# --------------------------------------------------------------------------------------------
# Outputs that are inputs, or that would replace a file of another kind
# --------------------------------------------------------------------------------------------

class OutputIsInputError(QkropeError, ValueError):
    """An output path names one of the command's inputs (or their sidecars), or an existing file
    that is not what would be written there; nothing was written."""


ONNX_MODEL = "an ONNX model"
MODEL_SIDECAR = "a qkrope model sidecar"
ENGINE_SIDECAR = "a qkrope engine sidecar"
JSON_FILE = "a JSON file"
TEXT_FILE = "a text file"


def looks_like_onnx(path: str | os.PathLike) -> bool:
    """The first bytes of a ModelProto as onnx writes it: ir_version (field 1, a small varint),
    then another ModelProto field in order (producer_name ... opset_import)."""
    with open(path, "rb") as f:
        head = f.read(3)
    return (len(head) == 3 and head[0] == 0x08 and 1 <= head[1] <= 64
            and head[2] in (0x12, 0x1A, 0x22, 0x28, 0x32, 0x3A, 0x42))


def file_kind(path: str | os.PathLike) -> str | None:
    """What an existing regular file recognisably is (:data:`ONNX_MODEL`, :data:`MODEL_SIDECAR`,
    :data:`ENGINE_SIDECAR`, :data:`JSON_FILE`, :data:`TEXT_FILE`), or None: missing, empty, not
    a regular file, unreadable, or binary data of no known kind (an engine, a timing cache)."""
    try:
        if not os.path.isfile(path) or os.path.getsize(path) == 0:
            return None
        if looks_like_onnx(path):
            return ONNX_MODEL
        with open(path, "rb") as f:
            head = f.read(1 << 16)
    except OSError:
        return None
    if b"\0" in head:
        return None
    try:
        text = head.decode("utf-8")
    except UnicodeDecodeError as exc:
        if exc.start < len(head) - 4:  # not just a character cut at the end of the read
            return None
        text = head[:exc.start].decode("utf-8")
    if text.lstrip().startswith(("{", "[")):
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError, RecursionError):
            return TEXT_FILE
        fmt = data.get("format") if isinstance(data, dict) else None
        fmt = fmt if isinstance(fmt, str) else None  # a list or object is no kind (unhashable)
        return {"qkrope-onnx": MODEL_SIDECAR, "qkrope-engine": ENGINE_SIDECAR}.get(fmt, JSON_FILE)
    return TEXT_FILE


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """``a`` and ``b`` name one file: the same inode (symlinks followed, hard links) when both
    exist, else the same resolved path."""
    try:
        if os.path.exists(a) and os.path.exists(b):
            return os.path.samefile(a, b)
    except OSError:
        pass
    return Path(a).resolve() == Path(b).resolve()


def check_outputs(outputs: Sequence[tuple[str | os.PathLike, str, Sequence[str]]],
                  inputs: Sequence[str | os.PathLike | None] = (), *,
                  flag: str = "--out") -> None:
    """Refuse, before any work, outputs that would destroy something. ``outputs``: ``(path, what
    is written there, the kinds it may replace)`` (kinds of :func:`file_kind`; an unrecognised
    binary file may always be replaced); ``inputs``: every file the command reads (None
    skipped). Raises :class:`OutputIsInputError` naming the path and the fix."""
    for out, what, replaceable in outputs:
        for given in inputs:
            if given is not None and same_file(out, given):
                raise OutputIsInputError(
                    f"the output {out} ({what}) is the same file as {given}, which this command "
                    f"also reads or writes: writing it would destroy that. Fix: choose another "
                    f"{flag}")
        kind = file_kind(out)
        if kind is not None and kind not in replaceable:
            raise OutputIsInputError(
                f"{out} exists and is {kind}, not {what}; it is not replaced. Fix: choose "
                f"another {flag}, or move {out} away")


# --------------------------------------------------------------------------------------------
# Staged groups of outputs
# --------------------------------------------------------------------------------------------

def _start_time(pid: int) -> int:
    """The process's start time (clock ticks since boot, /proc/<pid>/stat field 22), 0 where
    unknown; with the PID it identifies a process across PID reuse."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


def _alive(pid: int, start: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, owned by someone else
    now = _start_time(pid)
    return not (start and now and now != start)


def remove_stale_staging(folder: str | os.PathLike) -> list[Path]:
    """Remove the staging folders in ``folder`` whose process is gone (killed mid-write); the
    ones of live processes (a concurrent writer) are kept. Returns what was removed."""
    removed = []
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return removed
    for entry in entries:
        m = _STAGING_RE.match(entry.name)
        if m is None or entry.path in _ACTIVE:
            continue
        pid, start = int(m.group(1)), int(m.group(2))
        # This process's own folders not in use are leftovers; another live process's are its.
        if pid != os.getpid() and _alive(pid, start):
            continue
        shutil.rmtree(entry.path, ignore_errors=True)
        removed.append(Path(entry.path))
    return removed


def _on_signal(signum, frame):  # noqa: ARG001 - signal handler signature
    if getattr(_COMMITTING, "depth", 0):
        _PENDING_SIGNALS.append(signum)  # finish the commit first
        return
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def _signals_cleanup() -> Iterator[None]:
    """SIGTERM/SIGHUP raise SystemExit(128 + signum) so the staging folder is removed on the way
    out; installed only in the main thread, over the default action, and restored after."""
    installed = []
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, getattr(signal, "SIGHUP", None)):
            if sig is not None and signal.getsignal(sig) == signal.SIG_DFL:
                installed.append((sig, signal.signal(sig, _on_signal)))
    try:
        yield
    finally:
        for sig, previous in installed:
            signal.signal(sig, previous)


def _fsync_dir(folder: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def folder_lock(folder: str | os.PathLike, *, flag: str = "--out") -> Iterator[None]:
    """An exclusive advisory lock (``flock``) on ``folder`` itself, held for the block: the
    commits of concurrent writers into one folder (other processes, or other threads: each call
    opens its own descriptor) run one after the other. Nothing is created in the folder; a
    filesystem without flock (some network mounts) commits unlocked."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError as exc:
        raise output_error(exc, folder, flag=flag) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as exc:
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL):
                raise
        yield
    finally:
        os.close(fd)  # releases the lock


class Staging:
    """The staging folder of one group of outputs (see :func:`staged_outputs`)."""

    def __init__(self, folder: Path, dir: Path, names: Sequence[str], flag: str):
        self.folder, self.dir, self.names, self.flag = folder, dir, list(names), flag
        self.committed = False

    def path(self, name: str) -> Path:
        """Where to write the output ``name`` (a plain file name in the target folder)."""
        if name not in self.names:
            raise ValueError(f"{name!r} is not one of the staged outputs {self.names}")
        return self.dir / name

    def commit(self, order: Sequence[str], *, remove: Sequence[str] = ()) -> list[Path]:
        """Move the staged files ``order`` into the target folder in that order, then take the
        targets ``remove`` away (stale companions). On any failure every target is put back as it
        was and the error raised; signals wait for the end. Returns the paths written."""
        for name in list(order) + list(remove):
            self.path(name)
            target = self.folder / name
            if target.is_dir() and not target.is_symlink():
                raise OutputWriteError(errno.EISDIR, f"cannot write {target}: {target} is a "
                                                     f"directory; remove it or choose another "
                                                     f"{self.flag}")
        for name in order:
            if not (self.dir / name).is_file():
                raise ValueError(f"staged output {name!r} was not written")
        backups = self.dir / ".old"
        backups.mkdir()
        done: list[tuple[str, bool]] = []  # (name, had an old file)
        _COMMITTING.depth = getattr(_COMMITTING, "depth", 0) + 1
        try:
            with folder_lock(self.folder, flag=self.flag):
                self._commit(order, remove, backups, done)
            self.committed = True
        finally:
            _COMMITTING.depth -= 1
            if not _COMMITTING.depth and _PENDING_SIGNALS:
                signum = _PENDING_SIGNALS.pop()
                _PENDING_SIGNALS.clear()
                raise SystemExit(128 + signum)
        return [self.folder / n for n in order]

    def _commit(self, order, remove, backups: Path, done: list[tuple[str, bool]]) -> None:
        try:
            for name in order:
                target = self.folder / name
                had = self._backup(target, backups / name)
                os.replace(self.dir / name, target)
                done.append((name, had))
            for name in remove:
                target = self.folder / name
                if target.exists() or target.is_symlink():
                    os.replace(target, backups / name)
                    done.append((name, True))
            _fsync_dir(self.folder)
        except BaseException:
            self._rollback(done, backups)
            raise

    @staticmethod
    def _backup(target: Path, backup: Path) -> bool:
        if not (target.exists() or target.is_symlink()):
            return False
        try:
            os.link(target, backup, follow_symlinks=False)
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EXDEV, errno.EMLINK,
                                 errno.EOPNOTSUPP):
                raise
            shutil.copy2(target, backup, follow_symlinks=False)  # no hard links here
        return True

    def _rollback(self, done: list[tuple[str, bool]], backups: Path) -> None:
        for name, had in reversed(done):
            target = self.folder / name
            with contextlib.suppress(OSError):
                if had:
                    os.replace(backups / name, target)
                else:
                    os.unlink(target)


@contextlib.contextmanager
def staged_outputs(folder: str | os.PathLike, names: Sequence[str], *,
                   flag: str = "--out") -> Iterator[Staging]:
    """A hidden staging folder in ``folder`` for the outputs ``names``; write them with
    :meth:`Staging.path`, then call :meth:`Staging.commit`. Leaving the block (commit or not,
    exception, SIGTERM) removes the staging folder; stale ones of dead processes are removed on
    entry. OS errors inside the block become :class:`OutputWriteError` naming ``folder``."""
    folder = check_output_folder(folder, flag=flag)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise output_error(exc, folder, flag=flag) from None
    remove_stale_staging(folder)
    pid = os.getpid()
    dir = folder / f"{STAGING_PREFIX}{pid}-{_start_time(pid)}-{secrets.token_hex(4)}"
    with _signals_cleanup():
        try:
            dir.mkdir()
        except OSError as exc:
            raise output_error(exc, folder, flag=flag) from None
        _ACTIVE.add(str(dir))
        try:
            yield Staging(folder, dir, names, flag)
        except OSError as exc:
            raise output_error(exc, folder / (names[0] if names else ""), flag=flag) from None
        finally:
            shutil.rmtree(dir, ignore_errors=True)
            _ACTIVE.discard(str(dir))
