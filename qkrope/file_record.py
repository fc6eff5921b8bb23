"""What a sidecar records of each large file it describes, so that a load checks it with one
``stat`` instead of hashing the weights (docs/spec.md section 4, "The check on load").

A :class:`FileRecord` is the file's sha256, taken once by the writer, plus its size, ``st_mtime_ns``
and inode number at that moment. The writer takes it on the staged file; the commit's rename
keeps all three (same filesystem), so a record made in staging is the one the reader finds.

:func:`verify` is the reader's check:

- fast (every load): the file's size, mtime_ns and inode equal the record's -> accepted without
  reading it. What this catches: a file replaced by a rename or ``mv`` (new inode), rewritten in
  place by ``cp``/``cp -p``/an editor/a re-export (new mtime), truncated or grown (size).
- full (``full=True``: ``qkrope check``; the environment variable ``QKROPE_VERIFY=full`` for every
  load; and whenever the fast check fails): the file is hashed and its sha256 decides. A file
  copied, ``rsync -a``-ed, restored from a backup or checked out again has a new inode or mtime
  but the recorded content: it is accepted, and the reader refreshes the record
  (:func:`refresh_sidecar`: atomic, only when the sidecar is unchanged, writable and not being
  committed by a writer), so the
  next load is fast again.
- what the fast check does not see: content rewritten in place, at the same size, whose
  mtime was then put back to the recorded nanosecond by hand (``os.utime``/``touch -d`` with the
  old time): nothing a tool does while replacing a file. ``qkrope check`` (always the full hash)
  refuses it. A pair from two writers is refused by the write id besides (the sidecar's
  ``write_id`` must be the one in the model's metadata or the engine's name), whatever the
  stat says.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from qkrope._fileio import sha256_file, write_json_atomic

VERIFY_ENV = "QKROPE_VERIFY"  # "full": every load hashes (as `qkrope check` does)
#: The documented values of QKROPE_VERIFY (unset or empty: "stat"); anything else is refused.
VERIFY_VALUES = {"stat": "the stat record, then the hash where it differs (the default)",
                 "full": "every load hashes every file"}
_HEX64 = re.compile(r"[0-9a-f]{64}")
WRITE_ID_RE = re.compile(r"[0-9a-f]{16}")


def new_write_id() -> str:
    """A random id one writer puts into both files of a pair (sidecar and model/engine)."""
    return secrets.token_hex(8)


def full_by_default() -> bool:
    """True when ``QKROPE_VERIFY=full`` asks every load for the full hash; False when it is
    unset, empty or ``stat``. Any other value (``1``, ``yes``, a typo) is an InputError: a
    security setting never falls back to the fast check silently."""
    value = os.environ.get(VERIFY_ENV)
    if value is None or value == "":
        return False
    if value not in VERIFY_VALUES:
        from qkrope.errors import InputError

        raise InputError(f"{VERIFY_ENV}={value!r} is not one of its values: "
                         + "; ".join(f"{k!r} ({v})" for k, v in VERIFY_VALUES.items())
                         + f". Fix: set {VERIFY_ENV}=full (or stat), or unset it")
    return value == "full"


@dataclass(frozen=True)
class FileRecord:
    """One file as its writer left it: content hash and the stat fields a replacement changes."""

    sha256: str
    size: int
    mtime_ns: int
    ino: int

    @classmethod
    def of(cls, path: str | os.PathLike, sha256: str | None = None) -> "FileRecord":
        """The record of ``path`` now (``sha256``: a digest the writer already has, else the
        file is hashed)."""
        st = os.stat(path)
        digest = sha256 if sha256 is not None else sha256_file(path)
        after = os.stat(path)
        if (after.st_size, after.st_mtime_ns, after.st_ino) != (st.st_size, st.st_mtime_ns,
                                                                 st.st_ino):
            raise OSError(f"{path} changed while it was hashed")
        return cls(digest, int(st.st_size), int(st.st_mtime_ns), int(st.st_ino))

    def stat_matches(self, path: str | os.PathLike) -> bool:
        try:
            st = os.stat(path)
        except OSError:
            return False
        return (st.st_size, st.st_mtime_ns, st.st_ino) == (self.size, self.mtime_ns, self.ino)

    def to_dict(self) -> dict[str, Any]:
        return {"sha256": self.sha256, "size": self.size, "mtime_ns": self.mtime_ns,
                "ino": self.ino}

    @classmethod
    def from_dict(cls, d: Any, fail: Callable[[str], Any], where: str) -> "FileRecord":
        if not isinstance(d, Mapping):
            fail(f"field {where!r} must be an object, got {type(d).__name__}")
        sha = d.get("sha256")
        if not isinstance(sha, str) or not _HEX64.fullmatch(sha):
            fail(f"field {where}.sha256 must be a sha256 hex digest, got {sha!r}")
        values = []
        for key in ("size", "mtime_ns", "ino"):
            v = d.get(key)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                fail(f"field {where}.{key} must be a non-negative int, got {v!r}")
            values.append(v)
        return cls(sha, *values)


@dataclass
class Verdict:
    """What :func:`verify` found: ``ok`` (the content is the recorded one), ``how`` ("stat": the
    fast check; "sha256": hashed), the file's sha256 when it was hashed, and a fresh record when
    the content matched but the stat did not (for :func:`refresh_sidecar`)."""

    ok: bool
    how: str
    actual: str | None = None
    fresh: FileRecord | None = None


def verify(path: str | os.PathLike, sha256: str, record: FileRecord | None, *,
           full: bool = False) -> Verdict:
    """Is ``path`` the file whose sha256 is ``sha256``? The stat check against ``record`` when
    there is one (and not ``full``), else the hash. OSError when it cannot be read."""
    if not full and record is not None and record.sha256 == sha256 and record.stat_matches(path):
        return Verdict(True, "stat")
    before = os.stat(path)
    actual = sha256_file(path)
    if actual != sha256:
        return Verdict(False, "sha256", actual)
    fresh = None
    if record is None or not record.stat_matches(path):
        fresh = FileRecord(actual, int(before.st_size), int(before.st_mtime_ns),
                           int(before.st_ino))
        if not fresh.stat_matches(path):  # changed while it was hashed: no new record
            fresh = None
    return Verdict(True, "sha256", actual, fresh)


def refresh_sidecar(side: Path, read: Any, update: Callable[[dict], None]) -> bool:
    """Rewrite the sidecar ``side`` with ``update`` applied to its JSON, atomically and under the
    folder's commit lock (the ``flock`` the writers take, :func:`qkrope._fileio.folder_lock`),
    but only while it still holds ``read`` (what the caller read and checked: a writer that
    replaced it meanwhile wins). The lock is tried, never waited for: a folder being written (by
    another process, or by this one around the load) is left alone. A read-only folder or any
    OS error leaves it as it is too (the next load hashes again). True when it was rewritten."""
    try:
        fd = os.open(side.parent, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with open(side, encoding="utf-8") as f:
            now = json.load(f)
        if now != read:
            return False
        data = json.loads(json.dumps(now))
        update(data)
        write_json_atomic(side, data)
        return True
    except (OSError, ValueError):  # BlockingIOError (the lock is held) is an OSError
        return False
    finally:
        os.close(fd)


__all__ = ["FileRecord", "Verdict", "verify", "refresh_sidecar", "new_write_id",
           "full_by_default", "VERIFY_ENV", "VERIFY_VALUES"]
