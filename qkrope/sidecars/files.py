"""The files a sidecar describes: their sha256 and stat records checked on load
(:mod:`qkrope.file_record`), the write id a pair shares, the external-data locations a graph
names, and an ONNX file's header (metadata_props, IR version, opsets) read without its graph."""

from __future__ import annotations

import os
import re
from pathlib import Path

from qkrope.file_record import WRITE_ID_RE, FileRecord, Verdict, verify

from .fields import _Fields
from .formats import SidecarError

def _varint(f) -> int | None:
    shift = value = 0
    while True:
        b = f.read(1)
        if not b:
            return None
        value |= (b[0] & 0x7F) << shift
        if b[0] < 0x80:
            return value
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")


def onnx_metadata_props(onnx_path: str | os.PathLike) -> dict[str, str]:
    """The ``metadata_props`` of an ONNX file, read without parsing its graph
    (:func:`onnx_header`). {} for a file that is not one."""
    return onnx_header(onnx_path)[0]


def onnx_header(onnx_path: str | os.PathLike) -> tuple[dict[str, str], int | None,
                                                      dict[str, int]]:
    """``(metadata_props, ir_version, {opset domain: version})`` of an ONNX file, read without
    parsing its graph: the top-level fields of the ModelProto are walked (the graph and
    everything else skipped by length) and only the metadata entries (field 14), the IR version
    (field 1) and the opset imports (field 8) decoded. ``({}, None, {})`` for a file that is not
    one."""
    import onnx

    out: dict[str, str] = {}
    ir_version, opsets = None, {}
    nothing: tuple[dict[str, str], int | None, dict[str, int]] = ({}, None, {})
    try:
        with open(onnx_path, "rb") as f:
            while True:
                tag = _varint(f)
                if tag is None:
                    return out, ir_version, opsets
                field_no, wire = tag >> 3, tag & 7
                if wire == 0:
                    value = _varint(f)
                    if value is None:
                        return nothing
                    if field_no == 1:
                        ir_version = value
                elif wire == 1:
                    f.seek(8, os.SEEK_CUR)
                elif wire == 5:
                    f.seek(4, os.SEEK_CUR)
                elif wire == 2:
                    n = _varint(f)
                    if n is None:
                        return nothing
                    if field_no == 14:
                        entry = onnx.StringStringEntryProto.FromString(f.read(n))
                        out[entry.key] = entry.value
                    elif field_no == 8:
                        op = onnx.OperatorSetIdProto.FromString(f.read(n))
                        opsets[op.domain] = int(op.version)
                    else:
                        f.seek(n, os.SEEK_CUR)
                else:
                    return nothing
    except Exception:  # noqa: BLE001 - unreadable, or not a protobuf: nothing recorded
        return nothing


def _sha256_field(f: _Fields, key: str) -> str | None:
    value = f.get(key, str, optional=True)
    if value is not None and not re.fullmatch(r"[0-9a-f]{64}", value):
        f.fail(f"field {key!r} must be a sha256 hex digest, got {value!r}")
    return value


def _check_file(path: str | os.PathLike, side: Path, recorded: str | None,
                record: "FileRecord | None", error: type[SidecarError], what: str, fix: str, *,
                full: bool) -> "Verdict | None":
    """``error`` when the sidecar ``side`` records the sha256 ``recorded`` of its file and
    ``path`` is another file (a stale sidecar, a pair of two writers, an interrupted write, a
    file replaced by hand). The stat record ``record`` answers without reading the file when it
    still matches (:func:`qkrope.file_record.verify`; ``full``: always hash). None: nothing
    recorded or no such file (not checked)."""
    if recorded is None or not os.path.isfile(path):
        return None
    try:
        verdict = verify(path, recorded, record, full=full)
    except OSError as exc:
        raise error(f"cannot read {path} to check it against its sidecar: {exc}") from None
    if not verdict.ok:
        actual, noun = verdict.actual or "?", what.removeprefix("the ")
        raise error(
            f"the sidecar {side} does not describe this {noun} ({path} has sha256 "
            f"{actual[:12]}…, the sidecar describes {recorded[:12]}…): {what} or its sidecar was "
            f"replaced, or a write was interrupted. Fix: {fix}")
    return verdict


def _records(f: _Fields, key: str) -> "dict[str, FileRecord]":
    raw = f.get(key, dict, optional=True, default={})
    out = {}
    for name, rec in raw.items():
        if not isinstance(name, str) or not name or os.path.isabs(name) or ".." in Path(name).parts:
            f.fail(f"field {key!r} names {name!r}, not a file beside the model")
        out[name] = FileRecord.from_dict(rec, f.fail, f"{key}[{name!r}]")
    return out


def _record(f: _Fields, key: str) -> "FileRecord | None":
    raw = f.get(key, dict, optional=True)
    return None if raw is None else FileRecord.from_dict(raw, f.fail, key)


def _write_id(f: _Fields) -> str | None:
    value = f.get("write_id", str, optional=True)
    if value is not None and not WRITE_ID_RE.fullmatch(value):
        f.fail(f"field 'write_id' must be 16 hex digits, got {value!r}")
    return value


def _two_writers(side: Path, path: str | os.PathLike, mine: str, theirs: str, what: str,
                 error: type[SidecarError], fix: str) -> SidecarError:
    return error(f"the sidecar {side} and {path} are from two different writes (write id "
                 f"{mine} in the sidecar, {theirs} in the {what}): one of the pair was replaced "
                 f"by another export/build's file. Fix: {fix}")


def _external_locations(onnx_path: str | os.PathLike) -> list[str]:
    """The external-data locations the graph of ``onnx_path`` names (weights not loaded)."""
    import onnx

    try:
        model = onnx.load(str(onnx_path), load_external_data=False)
    except Exception:  # noqa: BLE001 - not an ONNX file (a test's stand-in): none
        return []
    return sorted({e.value for t in model.graph.initializer for e in t.external_data
                   if e.key == "location"})
