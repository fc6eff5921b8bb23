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
last), and the commit's journal (:data:`COMMIT_JOURNAL`, written before the first rename) lets
the next writer or reader in that folder finish the renames (:func:`_finish_commit`): the old
group or the new one, never half of each. OS errors become :class:`OutputWriteError`, one line
naming the path and the fix.

A stale staging folder is only ever acted on within what its writer did: the staging folder is
private (0700), its journal records the staging folder's name and the identity (inode, size,
mtime; the device is recorded but not compared, as a remount renumbers it) of each staged file
and of each file to remove, and every note of a moved-away folder records its place below the
staging folder's parent and its identity (a note that records only a path, as older ones did,
is refused). The next writer or reader opens them without following links (``O_NOFOLLOW``,
``dir_fd``) and moves or removes a file only when it is that very file; a staging folder that
is a link, writable by others (with a journal or notes in it), or whose journal or note names
anything else (a path outside the folder, a file its writer did not stage, the user's own file)
is refused in one line (:class:`StaleStagingError`; for a commit stopped half way, the line
names the staged files still to move in and where) and nothing it names is touched. Staging folders of live processes
and of other users, and names qkrope does not make, are left alone.

An output may be a folder (``qkrope quantize``'s model folder): it is staged whole inside the
staging folder and moved in by :func:`swap_dir`: one atomic exchange with the old folder
(``renameat2(RENAME_EXCHANGE)``; the target is never missing), or where the file system has none,
two renames with the old folder parked in the staging folder's ``.replaced/`` beside a note of its
place: a kill between the two leaves the target missing until the next writer in that folder
(:func:`remove_stale_staging`) or a reader (:func:`recover`, called by the preflight of input
folders) puts it back. Staged folders get the umask's modes before the commit.

Concurrent writers of one folder: every commit holds an advisory lock on the target folder
(``flock`` on the folder itself, :func:`folder_lock`), so two writers of one group commit one after
the other and the group is always one writer's complete result (each pair also records the hash of
its large file: a mismatched pair is refused by the readers). Every "may this target be replaced?"
decision is taken again under that lock (``staged_outputs(kinds=...)``), so a file another writer
put there meanwhile is judged, not overwritten.

Before any work, the writers check their outputs (:func:`check_outputs`): an output that is one of
the command's inputs or their sidecars (same file after symlinks, or a hard link), or a folder
output containing one, is refused, and so is an existing file or folder that recognisably is
something else than what is written there. One rule for every writer, :data:`REPLACES`
(:func:`file_kind` says what is there): an output replaces its own kind, an empty file or folder
and, for a file, binary data of no recognised kind (an old engine or timing cache); never a text
or JSON file, a model or sidecar of another kind, or a folder that is not a previous output.
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
import stat
import tempfile
import threading
from pathlib import Path
from typing import Any, Iterator, Sequence

from qkrope.errors import QkropeError

STAGING_PREFIX = ".qkrope-staging-"
_STAGING_RE = re.compile(re.escape(STAGING_PREFIX) + r"(\d{1,10})-(\d{1,20})-[0-9A-Za-z_]+$")
_ACTIVE: set[tuple[int, int]] = set()  # (st_dev, st_ino) of this process's staging folders in use
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


def plain_mode(*, folder: bool) -> int:
    """The mode a plain ``mkdir`` (``folder``) or ``open(path, "w")`` gives under the current
    umask: for folders made by ``tempfile.mkdtemp`` (0700) and files by ``mkstemp`` (0600) that
    become outputs."""
    return (0o777 if folder else 0o666) & ~_umask()


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
        os.chmod(tmp, plain_mode(folder=False))
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


# errnos of a hard link the filesystem cannot make (another filesystem, no hard links there, the
# file's link count at its limit): the file is copied instead
NO_HARD_LINK = (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP)


FICLONE = 0x40049409  # Linux ioctl: make dst share src's extents, copy-on-write (btrfs, XFS, ...)


def clone_or_copy(src: str | os.PathLike, dst: str | os.PathLike) -> str:
    """``dst`` becomes an independent copy of ``src``: a copy-on-write clone (``FICLONE``) where
    the filesystem makes one (no bytes copied, and a later in-place rewrite of either file leaves
    the other as it was), else a plain copy. Returns "cloned" or "copied"; an OS error of the copy
    itself (a full disk) is raised."""
    try:
        import fcntl

        with open(src, "rb") as s, open(dst, "wb") as d:
            fcntl.ioctl(d.fileno(), FICLONE, s.fileno())
        return "cloned"
    except (ImportError, OSError):
        pass  # no reflink here (ext4, tmpfs, another filesystem): copy the bytes below
    shutil.copyfile(src, dst)
    return "copied"


def link_or_copy(src: str | os.PathLike, dst: str | os.PathLike, *, link: bool = False) -> str:
    """``dst`` becomes ``src``'s content. By default an independent copy (:func:`clone_or_copy`:
    a copy-on-write clone where the filesystem has one), so rewriting ``src`` in place later never
    changes ``dst``. With ``link`` (the caller's explicit choice) a hard link where the
    filesystem allows one (both names share one inode: an in-place rewrite of ``src`` changes
    ``dst`` too), else a copy. Returns "hard-linked", "cloned" or "copied"; other OS errors (a
    full disk) are raised."""
    if link:
        try:
            os.link(src, dst)
            return "hard-linked"
        except OSError as exc:
            if exc.errno not in NO_HARD_LINK:
                raise
    return clone_or_copy(src, dst)


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


# What file_kind recognises in an existing file or folder, and what the writers write.
ONNX_MODEL = "an ONNX model"
MODEL_SIDECAR = "a qkrope model sidecar"
ENGINE_SIDECAR = "a qkrope engine sidecar"
JSON_FILE = "a JSON file"
TEXT_FILE = "a text file"
QUANTIZED_MODEL = "a quantised model folder (qkrope quantize)"
FOLDER = "a folder"
# Outputs that file_kind cannot tell from other binary data (written, never recognised).
TENSORRT_ENGINE = "a TensorRT engine"
TIMING_CACHE = "a TensorRT timing cache"
EXTERNAL_DATA = "an ONNX model's external data"
CALIBRATION = "a qkrope calibration file"

#: The one rule for replacing an existing output: what each kind of output may replace besides
#: a missing or empty file or folder and (for a file) binary data of no recognised kind. A text
#: or JSON file, a model or sidecar of another kind, a folder that is not a previous output of
#: the same command are never replaced.
REPLACES: dict[str, frozenset[str]] = {
    ONNX_MODEL: frozenset({ONNX_MODEL}),
    MODEL_SIDECAR: frozenset({MODEL_SIDECAR}),
    ENGINE_SIDECAR: frozenset({ENGINE_SIDECAR}),
    TENSORRT_ENGINE: frozenset(),
    TIMING_CACHE: frozenset(),
    EXTERNAL_DATA: frozenset(),
    CALIBRATION: frozenset(),  # a torch zip archive: binary, so an old one may be replaced
    QUANTIZED_MODEL: frozenset({QUANTIZED_MODEL}),
}
#: How messages name what is written (the kinds name what is found).
_WRITTEN_AS = {MODEL_SIDECAR: "a model sidecar", ENGINE_SIDECAR: "an engine sidecar"}
#: Outputs that are folders (replaced whole).
FOLDER_OUTPUTS = frozenset({QUANTIZED_MODEL})
_SIDECAR_FORMATS = {"qkrope-onnx": MODEL_SIDECAR, "qkrope-engine": ENGINE_SIDECAR}
_DAMAGED_SIDECAR_RE = re.compile(r'"format"\s*:\s*"(qkrope-onnx|qkrope-engine)"')


def looks_like_onnx(path: str | os.PathLike) -> bool:
    """The first bytes of a ModelProto as onnx writes it: ir_version (field 1, a small varint),
    then another ModelProto field in order (producer_name ... opset_import)."""
    with open(path, "rb") as f:
        head = f.read(3)
    return (len(head) == 3 and head[0] == 0x08 and 1 <= head[1] <= 64
            and head[2] in (0x12, 0x1A, 0x22, 0x28, 0x32, 0x3A, 0x42))


def _folder_kind(path: str | os.PathLike) -> str | None:
    """None for an empty folder, :data:`QUANTIZED_MODEL` for what ``qkrope quantize`` writes (a
    diffusers ``config.json`` beside ModelOpt's state), else :data:`FOLDER`."""
    from qkrope.quantization import MODELOPT_STATE_FILE

    try:
        names = {e.name for e in os.scandir(path)}
    except OSError:
        return FOLDER
    if not names:
        return None
    if {"config.json", MODELOPT_STATE_FILE} <= names:
        return QUANTIZED_MODEL
    return FOLDER


def file_kind(path: str | os.PathLike) -> str | None:
    """What an existing file or folder recognisably is (:data:`ONNX_MODEL`,
    :data:`MODEL_SIDECAR`, :data:`ENGINE_SIDECAR` (a damaged one too), :data:`JSON_FILE`,
    :data:`TEXT_FILE`, :data:`QUANTIZED_MODEL`, :data:`FOLDER`), or None: missing, empty, not a
    regular file or folder, unreadable, or binary data of no known kind (an engine, a timing
    cache). A symlink is judged by what it points to."""
    try:
        if os.path.isdir(path):
            return _folder_kind(path)
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
            m = _DAMAGED_SIDECAR_RE.search(text)  # a truncated sidecar is still a sidecar
            return _SIDECAR_FORMATS[m.group(1)] if m else TEXT_FILE
        fmt = data.get("format") if isinstance(data, dict) else None
        return _SIDECAR_FORMATS.get(fmt, JSON_FILE) if isinstance(fmt, str) else JSON_FILE
    return TEXT_FILE


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """``a`` and ``b`` name one file: the same inode (symlinks followed, hard links) when both
    exist, else the same resolved path."""
    try:
        if os.path.exists(a) and os.path.exists(b):
            return os.path.samefile(a, b)
    except OSError:
        pass
    # realpath, not Path.resolve: a symbolic link loop is compared as its name, never raised
    return os.path.realpath(a) == os.path.realpath(b)


def _inside(inner: str | os.PathLike, outer: str | os.PathLike) -> bool:
    """``inner`` is ``outer`` or lies somewhere below it (symlinks followed)."""
    try:
        a, b = Path(inner).resolve(), Path(outer).resolve()
    except (OSError, RuntimeError):
        return False
    return a == b or b in a.parents


def check_outputs(outputs: Sequence[tuple[str | os.PathLike, str]],
                  inputs: Sequence[str | os.PathLike | None] = (), *,
                  flag: str = "--out") -> None:
    """Refuse outputs that would destroy something (before any work, and again under the
    folder lock when :func:`staged_outputs` is given the kinds). ``outputs``: ``(path, what is
    written there)``, a kind of :data:`REPLACES`; ``inputs``: every file or folder the command
    reads (None skipped). An output that is an input (same file after symlinks, a hard link), a
    folder output that contains an input, or an existing file or folder that :data:`REPLACES`
    does not let the output replace: :class:`OutputIsInputError` naming the path and the fix; a
    file output where a folder is: :class:`OutputWriteError` (EISDIR)."""
    for out, written in outputs:
        if written not in REPLACES:
            raise ValueError(f"unknown kind of output {written!r}; one of {sorted(REPLACES)}")
        what = _WRITTEN_AS.get(written, written)
        folder_out = written in FOLDER_OUTPUTS
        for given in inputs:
            if given is None:
                continue
            if same_file(out, given):
                raise OutputIsInputError(
                    f"the output {out} ({what}) is the same file as {given}, which this command "
                    f"also reads or writes: writing it would destroy that. Fix: choose another "
                    f"{flag}")
            if folder_out and _inside(given, out):
                raise OutputIsInputError(
                    f"the output folder {out} contains {given}, which this command reads: "
                    f"replacing the folder would delete it. Fix: choose another {flag} (a new "
                    f"folder outside the inputs)")
        exists = os.path.lexists(out)
        if exists and folder_out and os.path.islink(out):
            raise OutputIsInputError(
                f"{out} is a symbolic link; a folder output replaces the folder itself, not "
                f"what a link points to. Fix: pass {os.path.realpath(out)} or another {flag}")
        if exists and os.path.isdir(out) and not folder_out:
            raise OutputWriteError(errno.EISDIR, f"cannot write {out}: {out} is a directory; "
                                                 f"remove it or choose another {flag}")
        if exists and folder_out and not os.path.isdir(out):
            raise OutputIsInputError(
                f"{out} exists and is {file_kind(out) or 'a file'}, not a folder; it is not "
                f"replaced. Fix: choose another {flag}, or move {out} away")
        kind = file_kind(out)
        if kind is not None and kind not in REPLACES[written]:
            raise OutputIsInputError(
                f"{out} exists and is {kind}, not {what}; it is not replaced. Fix: choose "
                f"another {flag}, or move {out} away")


def check_not_inputs(outputs: Sequence[str | os.PathLike],
                     inputs: Sequence[str | os.PathLike | None], *, flag: str) -> None:
    """Before any work, for outputs of no kind of :data:`REPLACES` (a command's work files,
    e.g. ``qkrope check --workdir``'s): none is one of ``inputs`` (same file after symlinks, a
    hard link; None skipped), whatever names it; else one :class:`OutputIsInputError`."""
    for out in outputs:
        for given in inputs:
            if given is not None and same_file(out, given):
                raise OutputIsInputError(
                    f"{flag} would write {out}, which is {given}, one of this command's inputs: "
                    f"writing it would destroy that. Fix: choose another {flag}")


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


_PID_MAX = 1 << 22  # Linux's PID_MAX_LIMIT: no process has a larger pid


def _staging_owner(name: str) -> tuple[int, int] | None:
    """``(pid, start time)`` of the writer that made a staging folder named ``name``; None for a
    name qkrope does not make (another prefix, a pid that does not parse or no process has)."""
    m = _STAGING_RE.match(name)
    if m is None:
        return None
    pid, start = int(m.group(1)), int(m.group(2))
    return (pid, start) if 1 <= pid <= _PID_MAX else None


REPLACED = ".replaced"  # in a staging folder: folders moved away mid-commit (see swap_dir)
_TARGET_SUFFIX = ".target"  # beside each: a note of the place it was moved away from
COMMIT_JOURNAL = ".commit.json"  # in a staging folder while its commit renames files
_JOURNAL_FORMAT = "qkrope-commit-journal-2"
_NOTE_FORMAT = "qkrope-replaced-2"
_O_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)


class StaleStagingError(OutputWriteError):
    """A staging folder left in an output folder (or its commit journal, or a note of a folder
    it moved away) is not as qkrope leaves one: a link, writable by others, or naming what its
    writer did not stage there. Nothing it names was moved or removed; the message names it and
    the fix."""


def _refuse(staging: Path, what: str, fix: str = "") -> StaleStagingError:
    return StaleStagingError(
        f"stale staging folder {staging} {what}; it is not acted on: nothing it names is moved "
        f"or removed. Fix: {fix or 'inspect it and remove it by hand'}")


def _bare(name: object) -> bool:
    """A plain file name: no folder part, not '.' or '..'."""
    return (isinstance(name, str) and name not in ("", ".", "..") and "/" not in name
            and "\0" not in name and not (os.altsep and os.altsep in name))


def _file_id(st: os.stat_result) -> list[int]:
    """What a journal records of a staged file or a file to remove: [device, inode, size,
    mtime] (renames keep all four). The device is recorded but is no part of the identity
    (:func:`_same_id`)."""
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]


def _same_id(recorded: list[int], st: os.stat_result) -> bool:
    """``st`` is the file (four numbers, :func:`_file_id`) or folder (two: device, inode, see
    :func:`_replaced_note`) that was recorded: the same inode, and for a file the same size
    and mtime. Not the device: a remount renumbers it (overlayfs after a container restart, an
    NFS remount), so comparing it would refuse a legitimate recovery and leave a commit half
    done; the descriptors every name is looked up through already pin the filesystem."""
    now = _file_id(st) if len(recorded) == 4 else [st.st_dev, st.st_ino]
    return recorded[1:] == now[1:]


def _trusted(st: os.stat_result) -> bool:
    """Owned by the current user and writable by no one else."""
    return st.st_uid == os.geteuid() and not st.st_mode & 0o022


def _exists_at(name: str, dir_fd: int) -> bool:
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _read_at(name: str, dir_fd: int, limit: int = 1 << 20) -> tuple[str, os.stat_result]:
    """The text of the regular file ``name`` in ``dir_fd`` (a link is not followed, a FIFO not
    waited on), and its stat."""
    fd = os.open(name, os.O_RDONLY | _O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0),
                 dir_fd=dir_fd)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ValueError("not a regular file")
        chunks, size = [], 0
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                raise ValueError(f"larger than {limit} bytes")
        return b"".join(chunks).decode("utf-8"), st
    finally:
        os.close(fd)


def _write_private(path: Path, text: str) -> None:
    """A new file only this user may write (a journal, a note), fsynced."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _open_dirs_at(dir_fd: int, parts: Sequence[str]) -> int:
    """A new descriptor of the folder ``parts`` below ``dir_fd``, no component followed if it is
    a link (ELOOP/ENOTDIR); ``parts`` empty: ``dir_fd``'s folder itself."""
    fd = os.open(".", _O_DIR, dir_fd=dir_fd)
    for part in parts:
        try:
            nxt = os.open(part, _O_DIR | _O_NOFOLLOW, dir_fd=fd)
        finally:
            os.close(fd)
        fd = nxt
    return fd


def _empty_at(fd: int) -> None:
    """Remove everything inside the folder open at ``fd``, through descriptors only: no link is
    followed, and a subfolder is emptied only if it is the one just looked at (best effort:
    what cannot be removed stays)."""
    try:
        names = os.listdir(fd)
    except OSError:
        return
    for name in names:
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode):
            try:
                sub = os.open(name, _O_DIR | _O_NOFOLLOW, dir_fd=fd)
            except OSError:
                continue
            try:
                if os.path.samestat(st, os.fstat(sub)):
                    _empty_at(sub)
            finally:
                os.close(sub)
            with contextlib.suppress(OSError):
                os.rmdir(name, dir_fd=fd)
        else:
            with contextlib.suppress(OSError):
                os.unlink(name, dir_fd=fd)


def _remove_staging_at(parent_fd: int, name: str, fd: int) -> bool:
    """Remove the staging folder open at ``fd`` (checked through it), named ``name`` in the
    folder open at ``parent_fd``: its content through ``fd`` (:func:`_empty_at`), never by a
    path that could meanwhile name another folder (a co-user of a group-writable folder
    without the sticky bit can rename one there); then the folder itself, only while ``name``
    is still that folder. True when it is gone; a folder put under its name is left as it is."""
    _empty_at(fd)
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
        if not os.path.samestat(st, os.fstat(fd)):
            return False  # not the folder checked: left alone
        os.rmdir(name, dir_fd=parent_fd)
    except OSError:
        return False
    return True


@contextlib.contextmanager
def _flock(fd: int) -> Iterator[None]:
    """An exclusive ``flock`` on ``fd`` for the block (none where the filesystem has none)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError as exc:
        if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL):
            raise
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_UN)


def _note_place(folder: Path, staging: Path, note: str, text: str) -> tuple[list[str], list]:
    """Where the folder a note stands for was moved away from, as folder names below
    ``folder`` (the staging folder's parent), and the folder's identity. A note that records
    only a path (an older qkrope's, or a place outside ``folder``) carries no identity: nothing
    confirms that qkrope moved the folder beside it away from there, so it is refused like an
    older journal. Anything else: :class:`StaleStagingError`."""
    where = staging / REPLACED / note

    def bad(problem):
        return _refuse(staging, f"has a note {where} {problem}",
                       fix=f"inspect {staging / REPLACED}; move back by hand any folder in it "
                           f"that is yours, then remove {staging}")

    if not text.startswith("{"):
        moved = staging / REPLACED / note[:-len(_TARGET_SUFFIX)]
        raise _refuse(staging, f"has a note {where} that records only a path (as an older "
                               f"qkrope wrote), not the identity of the folder moved away, and "
                               f"cannot be checked",
                      fix=f"inspect it (the note names the place {moved} was moved away from), "
                          f"move back by hand what is yours, then remove {staging}")
    try:
        plan = json.loads(text)
    except ValueError:
        raise bad("that is not valid JSON") from None
    parts, ident = (plan.get("path"), plan.get("id")) if isinstance(plan, dict) else (0, 0)
    if not (isinstance(plan, dict) and plan.get("format") == _NOTE_FORMAT
            and isinstance(parts, list) and 1 <= len(parts) <= 8
            and isinstance(ident, list) and len(ident) == 2
            and all(type(i) is int for i in ident)):
        raise bad("that is not a note qkrope writes")
    if not all(_bare(p) for p in parts):
        raise bad(f"naming {'/'.join(map(str, parts))!r}, not a folder inside {folder}")
    return parts, ident


def _restore_replaced(folder: Path, folder_fd: int, staging: Path, staging_fd: int) -> None:
    """Put back the folders a killed commit had moved out of the way (``<staging>/.replaced``,
    see :func:`swap_dir`) whose place is still empty, each under the lock of the folder it goes
    back into. A folder goes back only to the place its note names below ``folder``, through no
    link, and only if it is the folder that was moved there (its identity, in the note); what
    does not check out is :class:`StaleStagingError` and nothing is moved."""
    where = staging / REPLACED
    fix = f"inspect {where}; move back by hand any folder in it that is yours, then remove {staging}"
    try:
        rfd = os.open(REPLACED, _O_DIR | _O_NOFOLLOW, dir_fd=staging_fd)
    except FileNotFoundError:
        return
    except OSError:
        raise _refuse(staging, f"has {where}, which is a link or not a folder", fix) from None
    try:
        if not _trusted(os.fstat(rfd)):
            raise _refuse(staging, f"has {where}, which another user owns or may write", fix)
        for note in sorted(os.listdir(rfd)):
            if not note.endswith(_TARGET_SUFFIX):
                continue
            moved = note[:-len(_TARGET_SUFFIX)]
            try:
                text, nst = _read_at(note, rfd)
            except (OSError, ValueError) as exc:
                raise _refuse(staging, f"has a note {where / note} that is not a file qkrope "
                                       f"wrote ({getattr(exc, 'strerror', None) or exc})",
                              fix) from None
            if not _trusted(nst):
                raise _refuse(staging, f"has a note {where / note} that another user owns or "
                                       f"may write", fix)
            parts, ident = _note_place(folder, staging, note, text)
            target = folder.joinpath(*parts)
            try:
                mst = os.stat(moved, dir_fd=rfd, follow_symlinks=False)
            except FileNotFoundError:
                continue  # put back already, or never moved
            if not stat.S_ISDIR(mst.st_mode) or not _same_id(ident, mst):
                raise _refuse(staging, f"has {where / moved}, which is not the folder qkrope "
                                       f"moved away from {target}", fix)
            try:
                pfd = _open_dirs_at(folder_fd, parts[:-1])
            except FileNotFoundError:
                continue  # the folder it came from is gone: nothing to put it back into
            except OSError:
                raise _refuse(staging, f"has a note {where / note} naming {target}, through a "
                                       f"link or a file", fix) from None
            try:
                with _flock(pfd):  # a live writer's commit there is not mid-way
                    if _exists_at(parts[-1], pfd):
                        continue
                    os.rename(moved, parts[-1], src_dir_fd=rfd, dst_dir_fd=pfd)
                    with contextlib.suppress(OSError):
                        os.fsync(pfd)
            except OSError as exc:
                raise OutputWriteError(exc.errno, f"cannot put {where / moved} back at {target} "
                                                  f"({exc.strerror}). Fix: move it back by hand, "
                                                  f"then remove {staging}") from None
            finally:
                os.close(pfd)
    finally:
        os.close(rfd)


def _journal_plan(folder: Path, staging: Path, text: str):
    """The commit journal's renames ``[(name, id)]``, removals ``[(name, id)]`` and kinds, if
    it is one qkrope writes for ``staging``; else :class:`StaleStagingError`."""
    def bad(problem):
        return _refuse(staging, f"has a commit journal {problem}")

    try:
        plan = json.loads(text)
    except ValueError:
        raise bad("that is not valid JSON") from None
    if not isinstance(plan, dict):
        raise bad("that is not a qkrope commit journal")
    entries = {}
    for key in ("order", "remove"):
        got = plan.get(key)
        if not isinstance(got, list):
            raise bad("that is not a qkrope commit journal")
        entries[key] = [e.get("name") if isinstance(e, dict) else e for e in got]
        for name in entries[key]:
            if not _bare(name):
                raise bad(f"naming {name!r}, not a file of {staging if key == 'order' else folder}")
    if plan.get("format") != _JOURNAL_FORMAT:
        raise _refuse(staging, "has a commit journal of an older qkrope, which does not record "
                               "what its writer staged and cannot be checked",
                      fix=f"inspect it (its journal lists the files its writer was moving into "
                          f"{folder}), move by hand what is yours, then remove it")
    if plan.get("staging") != staging.name:
        raise bad(f"written for another staging folder ({plan.get('staging')!r})")
    names = entries["order"] + entries["remove"]
    kinds = plan.get("kinds")
    ids = [e.get("id") if isinstance(e, dict) else None for e in plan["order"] + plan["remove"]]
    if len(set(names)) != len(names) or not all(
            isinstance(i, list) and len(i) == 4 and all(type(v) is int for v in i) for i in ids):
        raise bad("that is not a qkrope commit journal")
    if not isinstance(kinds, dict) or not all(
            n in names and k in REPLACES and k not in FOLDER_OUTPUTS for n, k in kinds.items()):
        raise bad(f"naming kinds qkrope does not write as files ({kinds!r})")
    pairs = list(zip(names, ids))
    return pairs[:len(entries["order"])], pairs[len(entries["order"]):], kinds


def _finish_by_hand(folder: Path, staging: Path, left: Sequence[str], gone: Sequence[str]) -> str:
    """The fix of a half-done commit that cannot be finished automatically: what is still to
    move in and where (and to remove), for the user who ran it to finish it by hand."""
    steps = [f"move {staging / n} to {folder / n}" for n in left]
    steps += [f"remove {folder / n}" for n in gone]
    if not steps:
        return "inspect it and remove it by hand"
    return (f"its writer's commit into {folder} stopped half way; if you ran it, finish it by "
            f"hand in this order: {', then '.join(steps)}; then (or if you did not run it) "
            f"remove {staging}")


def _finish_commit(folder: Path, folder_fd: int, staging: Path, staging_fd: int) -> bool:
    """A writer killed between two renames of its commit (its journal still in ``staging``):
    the renames it had not done are done now, in its order, then its removals, under the
    folder's lock, so the folder holds the new group whole (the readers' pairs match again),
    never the half of each. The journal must be the one its writer wrote for that folder, each
    file still to move the very file it staged there, each file to remove the very file it meant
    to remove (their identities, recorded in the journal, :func:`_same_id`): else
    :class:`StaleStagingError` naming what is still to move in and where
    (:func:`_finish_by_hand`), and nothing moves. Only where every target may still be replaced by what is written there
    (:func:`check_outputs` with the kinds it committed); else nothing is moved and the half
    state stays for the readers to refuse. True when the commit was finished."""
    try:
        text, jst = _read_at(COMMIT_JOURNAL, staging_fd)
    except (OSError, ValueError) as exc:
        raise _refuse(staging, f"has a commit journal qkrope cannot read as its own "
                               f"({getattr(exc, 'strerror', None) or exc})") from None
    if not _trusted(jst):
        raise _refuse(staging, "has a commit journal that another user owns or may write")
    order, remove, kinds = _journal_plan(folder, staging, text)
    lock_fd = _open_dirs_at(folder_fd, [])
    try:
        with _flock(lock_fd):
            left, gone, wrong = [], [], []
            for name, ident in order:
                try:
                    st = os.stat(name, dir_fd=staging_fd, follow_symlinks=False)
                except FileNotFoundError:
                    continue  # moved in before the kill
                if not stat.S_ISREG(st.st_mode) or not _same_id(ident, st):
                    wrong.append(f"{name!r}, which is not the file its writer staged there")
                left.append(name)
            for name, ident in remove:
                try:
                    st = os.stat(name, dir_fd=folder_fd, follow_symlinks=False)
                except FileNotFoundError:
                    continue  # removed before the kill
                if stat.S_ISDIR(st.st_mode) or not _same_id(ident, st):
                    wrong.append(f"{folder / name} to remove, which is not the file its writer "
                                 f"meant to remove")
                gone.append(name)
            if wrong:
                raise _refuse(staging, f"has a commit journal naming {wrong[0]}",
                              fix=_finish_by_hand(folder, staging, left, gone))
            try:
                check_outputs([(folder / n, kinds[n]) for n in left + gone if n in kinds], ())
            except (OutputIsInputError, OutputWriteError):
                return False  # a target is now something else: left as it is
            try:
                for name in left:
                    os.replace(name, name, src_dir_fd=staging_fd, dst_dir_fd=folder_fd)
                for name in gone:
                    os.unlink(name, dir_fd=folder_fd)
                with contextlib.suppress(OSError):
                    os.fsync(folder_fd)
                os.unlink(COMMIT_JOURNAL, dir_fd=staging_fd)
            except OSError:
                return False  # kept for a later writer to finish
            return True
    finally:
        os.close(lock_fd)


def _clear_stale(folder: Path, folder_fd: int, staging: Path, st: os.stat_result) -> bool:
    """One dead writer's staging folder (``st``: its lstat): its moved-away folders put back and
    its commit finished, if it has any, then it is removed through the descriptor it was checked
    through (:func:`_remove_staging_at`). True when it was removed."""
    if stat.S_ISLNK(st.st_mode):
        with contextlib.suppress(OSError):
            staging = Path(f"{staging} (a link to {os.readlink(staging)})")
        raise _refuse(staging, "is a symbolic link, not a folder qkrope made",
                      fix="inspect it and remove the link by hand")
    if not stat.S_ISDIR(st.st_mode):
        raise _refuse(staging, "is not a folder qkrope made")
    try:
        sfd = os.open(staging.name, _O_DIR | _O_NOFOLLOW, dir_fd=folder_fd)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise _refuse(staging, f"cannot be opened as a folder ({exc.strerror})") from None
    try:
        if not os.path.samestat(st, os.fstat(sfd)):
            raise _refuse(staging, "changed while qkrope checked it")
        journal, replaced = _exists_at(COMMIT_JOURNAL, sfd), _exists_at(REPLACED, sfd)
        if (journal or replaced) and st.st_mode & 0o022:
            raise _refuse(staging, f"is writable by others (mode {st.st_mode & 0o777:o}) and holds "
                                   f"a commit journal or moved-away folders that anyone could "
                                   f"have changed",
                          fix=f"inspect it; move back by hand what is yours, then remove it")
        if replaced:
            _restore_replaced(folder, folder_fd, staging, sfd)
        if journal and not _finish_commit(folder, folder_fd, staging, sfd):
            return False
        return _remove_staging_at(folder_fd, staging.name, sfd)
    finally:
        os.close(sfd)


def remove_stale_staging(folder: str | os.PathLike) -> list[Path]:
    """Remove the staging folders in ``folder`` whose process is gone (killed mid-write), after
    putting back any output folder such a process had moved away and not replaced (a kill
    between the two renames of :func:`swap_dir`) and finishing the file renames of a commit it
    was killed in the middle of (:func:`_finish_commit`). The ones of live processes (a
    concurrent writer) and of other users are kept, and so are names qkrope does not make.
    A staging folder that is not as qkrope leaves one (a link, writable by others with a journal
    or notes in it, a journal or note naming what its writer did not stage or a place outside
    ``folder``) is refused: :class:`StaleStagingError`, one line, before anything it names is
    moved or removed. A staging folder is removed through the descriptor it was checked through
    (:func:`_remove_staging_at`): a folder renamed to its name meanwhile is left alone. Returns
    what was removed."""
    removed: list[Path] = []
    folder = Path(folder)
    try:
        names = sorted(os.listdir(folder))
        folder_fd = os.open(folder, _O_DIR)
    except OSError:
        return removed
    try:
        for name in names:
            owner = _staging_owner(name)
            if owner is None:
                continue
            pid, start = owner
            # This process's own folders not in use are leftovers; another live process's are its.
            if pid != os.getpid() and _alive(pid, start):
                continue
            try:
                st = os.stat(name, dir_fd=folder_fd, follow_symlinks=False)
            except OSError:
                continue
            if (st.st_dev, st.st_ino) in _ACTIVE or st.st_uid != os.geteuid():
                continue  # in use by this process; another user's to finish
            if _clear_stale(folder, folder_fd, folder / name, st):
                removed.append(folder / name)
    finally:
        os.close(folder_fd)
    return removed


def recover(path: str | os.PathLike) -> bool:
    """For a reader that finds ``path`` missing: put back the output folder a killed writer
    had moved away from there (see :func:`remove_stale_staging`). True when ``path`` exists
    afterwards."""
    path = Path(path)
    if os.path.lexists(path):
        return True
    parent = path.parent
    while not parent.is_dir() and parent.parent != parent:
        parent = parent.parent
    remove_stale_staging(parent)
    return os.path.lexists(path)


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


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one step (Linux ``renameat2(RENAME_EXCHANGE)``); False where the
    system or the file system cannot, so the caller falls back to two renames."""
    import ctypes

    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    at_fdcwd, rename_exchange = -100, 2
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), str(b))


def _settle_tree(root: Path) -> None:
    """Before a staged output folder's commit: every file and folder below ``root`` gets the
    mode a plain ``open``/``mkdir`` gives under the umask (libraries writing into it may create
    0600 files or 0700 folders; the executable bits are kept), and is fsynced."""
    mask = _umask()
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            if os.path.islink(path):
                continue
            fd = os.open(path, os.O_RDONLY)
            try:
                mode = os.fstat(fd).st_mode
                want = (0o777 if mode & 0o111 else 0o666) & ~mask
                if mode & 0o7777 != want:
                    os.fchmod(fd, want)
                os.fsync(fd)
            finally:
                os.close(fd)
        if os.stat(dirpath).st_mode & 0o7777 != 0o777 & ~mask:
            os.chmod(dirpath, 0o777 & ~mask)
        _fsync_dir(Path(dirpath))


def _replaced_note(target: Path, replaced: Path) -> str:
    """The note beside a folder moved away to ``replaced`` (``<staging>/.replaced``): its place,
    as the folder names from the staging folder's parent down to it (through no link), and its
    identity, for :func:`_restore_replaced` to put back that folder only, only there. A place
    not below the staging folder's parent is recorded as its absolute path, with no identity,
    which :func:`_restore_replaced` refuses (the folder is then put back by hand)."""
    st = os.lstat(target)
    base = os.path.realpath(replaced.parent.parent)
    rel = os.path.relpath(os.path.join(os.path.realpath(target.parent), target.name), base)
    parts = rel.split(os.sep)
    if os.path.isabs(rel) or os.pardir in parts:
        return str(target.absolute())
    return json.dumps({"format": _NOTE_FORMAT, "path": parts, "id": [st.st_dev, st.st_ino]})


def swap_dir(staged: Path, target: Path, replaced: Path) -> str:
    """Put the folder ``staged`` at ``target`` with ``target`` never missing where the file
    system can help: a rename when there is no ``target``, else one atomic exchange (the old
    folder ends up at ``staged``, inside the staging folder that is removed afterwards).
    Without an atomic exchange, two renames: the old folder first moves to
    ``replaced/<name>.old`` with a note of ``target`` beside it (:func:`_replaced_note`), so that if the process dies
    before the second rename the next writer or reader in that folder
    (:func:`remove_stale_staging`, :func:`recover`) puts it back; on a failure it is put back
    at once. Returns how it was done ("new", "exchanged", "moved") for :func:`unswap_dir`."""
    if not os.path.lexists(target):
        os.rename(staged, target)
        return "new"
    if not target.is_dir() or target.is_symlink():
        raise OutputWriteError(errno.ENOTDIR, f"cannot replace {target}: it is not a folder")
    if _exchange(staged, target):
        return "exchanged"
    replaced.mkdir(mode=0o700, exist_ok=True)
    moved = replaced / (staged.name + ".old")
    _write_private(replaced / (moved.name + _TARGET_SUFFIX), _replaced_note(target, replaced))
    _fsync_dir(replaced)
    os.rename(target, moved)
    try:
        os.rename(staged, target)
    except BaseException:
        if not os.path.lexists(target):
            os.rename(moved, target)  # the old folder back before the staging is removed
        raise
    return "moved"


def unswap_dir(staged: Path, target: Path, replaced: Path, how: str) -> None:
    """Undo :func:`swap_dir` (a later output of the same commit failed)."""
    if how == "exchanged":
        if not _exchange(staged, target):
            raise OSError(errno.ENOTSUP, "cannot exchange back", str(target))
    else:
        os.rename(target, staged)
        if how == "moved":
            os.rename(replaced / (staged.name + ".old"), target)


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
        with _flock(fd):
            yield
    finally:
        os.close(fd)  # releases the lock


@contextlib.contextmanager
def committing() -> Iterator[None]:
    """A commit's renames: SIGTERM/SIGHUP (under :func:`staged_outputs`' handlers) wait until
    the block is done, then exit 128 + signum."""
    _COMMITTING.depth = getattr(_COMMITTING, "depth", 0) + 1
    try:
        yield
    finally:
        _COMMITTING.depth -= 1
        if not _COMMITTING.depth and _PENDING_SIGNALS:
            signum = _PENDING_SIGNALS.pop()
            _PENDING_SIGNALS.clear()
            raise SystemExit(128 + signum)


class Staging:
    """The staging folder of one group of outputs (see :func:`staged_outputs`)."""

    def __init__(self, folder: Path, dir: Path, names: Sequence[str], flag: str,
                 kinds: dict[str, str] | None = None,
                 inputs: Sequence[str | os.PathLike | None] = ()):
        self.folder, self.dir, self.names, self.flag = folder, dir, list(names), flag
        self.kinds, self.inputs = dict(kinds or {}), list(inputs)
        self.committed = False

    def path(self, name: str) -> Path:
        """Where to write the output ``name`` (a plain file name in the target folder; for a
        folder output, create the folder there)."""
        if name not in self.names:
            raise ValueError(f"{name!r} is not one of the staged outputs {self.names}")
        return self.dir / name

    def commit(self, order: Sequence[str], *, remove: Sequence[str] = ()) -> list[Path]:
        """Move the staged files and folders ``order`` into the target folder in that order
        (a folder by :func:`swap_dir`), then take the targets ``remove`` away (stale
        companions). Under the folder lock, first the targets are checked again
        (:func:`check_outputs` with the kinds given to :func:`staged_outputs`: a file another
        writer put there meanwhile is not replaced). On any failure every target is put back as
        it was and the error raised; signals wait for the end. Returns the paths written."""
        for name in list(order) + list(remove):
            self.path(name)
            target = self.folder / name
            if target.is_dir() and not target.is_symlink() and not (self.dir / name).is_dir():
                raise OutputWriteError(errno.EISDIR, f"cannot write {target}: {target} is a "
                                                     f"directory; remove it or choose another "
                                                     f"{self.flag}")
        for name in order:
            if not (self.dir / name).is_file() and not (self.dir / name).is_dir():
                raise ValueError(f"staged output {name!r} was not written")
            if (self.dir / name).is_dir():
                _settle_tree(self.dir / name)
        backups = self.dir / ".old"
        backups.mkdir()
        done: list[tuple[str, object]] = []  # (name, had an old file / how a folder moved)
        with committing(), folder_lock(self.folder, flag=self.flag):
            check_outputs([(self.folder / n, self.kinds[n]) for n in [*order, *remove]
                           if n in self.kinds], self.inputs, flag=self.flag)
            journal = self._journal(order, remove)
            try:
                self._commit(order, remove, backups, done)
            finally:
                journal.unlink(missing_ok=True)  # done, or rolled back
            self.committed = True
        return [self.folder / n for n in order]

    def _journal(self, order, remove) -> Path:
        """Before the first rename (under the folder lock): the commit's file renames and
        removals, for the next writer in the folder to finish should this process be killed
        between two renames (:func:`_finish_commit`; folders have their own note, see
        :func:`swap_dir`). It records the staging folder's name and the identity of each
        staged file and of each file to remove (:func:`_file_id`, :func:`_same_id`), so that only
        these very files are ever moved or removed by it."""
        journal = self.dir / COMMIT_JOURNAL
        files = [n for n in order if (self.dir / n).is_file()]
        gone = [n for n in remove if os.path.lexists(self.folder / n)]
        text = json.dumps({
            "format": _JOURNAL_FORMAT, "staging": self.dir.name,
            "order": [{"name": n, "id": _file_id(os.lstat(self.dir / n))} for n in files],
            "remove": [{"name": n, "id": _file_id(os.lstat(self.folder / n))} for n in gone],
            "kinds": {n: k for n, k in self.kinds.items() if n in files or n in gone}})
        _write_private(journal, text)
        _fsync_dir(self.dir)
        return journal

    def _commit(self, order, remove, backups: Path, done: list[tuple[str, object]]) -> None:
        try:
            for name in order:
                target = self.folder / name
                if (self.dir / name).is_dir():
                    done.append((name, swap_dir(self.dir / name, target, self.dir / REPLACED)))
                    continue
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

    def _rollback(self, done: list[tuple[str, object]], backups: Path) -> None:
        for name, had in reversed(done):
            target = self.folder / name
            with contextlib.suppress(OSError):
                if isinstance(had, str):  # a folder
                    unswap_dir(self.dir / name, target, self.dir / REPLACED, had)
                elif had:
                    os.replace(backups / name, target)
                else:
                    os.unlink(target)


@contextlib.contextmanager
def staged_outputs(folder: str | os.PathLike, names: Sequence[str], *,
                   flag: str = "--out", kinds: dict[str, str] | None = None,
                   inputs: Sequence[str | os.PathLike | None] = ()) -> Iterator[Staging]:
    """A hidden staging folder in ``folder`` for the outputs ``names`` (files, or folders
    replaced whole); write them with :meth:`Staging.path`, then call :meth:`Staging.commit`.
    ``kinds`` (name -> a kind of :data:`REPLACES`) and ``inputs``: the commit checks the
    targets again under the folder lock (:func:`check_outputs`). Leaving the block (commit or
    not, exception, SIGTERM) removes the staging folder; stale ones of dead processes are
    removed on entry (:func:`remove_stale_staging`: one that is not as qkrope leaves one is
    refused, :class:`StaleStagingError`, before anything is written). OS errors inside the block become :class:`OutputWriteError` naming
    ``folder``."""
    folder = check_output_folder(folder, flag=flag)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise output_error(exc, folder, flag=flag) from None
    remove_stale_staging(folder)
    pid = os.getpid()
    dir = folder / f"{STAGING_PREFIX}{pid}-{_start_time(pid)}-{secrets.token_hex(4)}"
    with _signals_cleanup():
        folder_fd = dir_fd = -1
        try:
            folder_fd = os.open(folder, _O_DIR)
            os.mkdir(dir.name, mode=0o700, dir_fd=folder_fd)  # private: no one else can put a
            try:                                              # journal or note in it
                dir_fd = os.open(dir.name, _O_DIR | _O_NOFOLLOW, dir_fd=folder_fd)
            except OSError:
                with contextlib.suppress(OSError):
                    os.rmdir(dir.name, dir_fd=folder_fd)
                raise
            st = os.fstat(dir_fd)
        except OSError as exc:
            for fd in (dir_fd, folder_fd):
                if fd >= 0:
                    os.close(fd)
            raise output_error(exc, folder, flag=flag) from None
        key = (st.st_dev, st.st_ino)
        _ACTIVE.add(key)
        try:
            yield Staging(folder, dir, names, flag, kinds, inputs)
        except OSError as exc:
            raise output_error(exc, folder / (names[0] if names else ""), flag=flag) from None
        finally:
            try:  # through its descriptor: a folder renamed to its name meanwhile is not removed
                _remove_staging_at(folder_fd, dir.name, dir_fd)
            finally:
                os.close(dir_fd)
                os.close(folder_fd)
                _ACTIVE.discard(key)
