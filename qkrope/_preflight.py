"""The first checks of every command: its files and folders exist and are what the command takes,
said before torch, onnx or TensorRT is imported (so a mistyped path answers at once, not after
the imports) and with the command that makes or takes the file.

Only the standard library is used here; the commands call these at the top of their ``run``.
What a file holds (a readable model, a valid sidecar, an engine TensorRT loads) is checked later,
where the libraries that read it are imported.
"""

from __future__ import annotations

import os
from pathlib import Path

from qkrope.errors import InputError, InputFileNotFoundError

ONNX_SUFFIXES = (".onnx",)
ENGINE_SUFFIXES = (".engine", ".plan", ".trt")
SIDECAR_SUFFIX = ".json"


def _with_suffix(p: Path, suffix: str) -> Path:
    """``p`` with ``suffix`` for a fix to suggest; a path without a file name (``.``, ``/``,
    ``..``: a folder) gets ``model<suffix>`` inside it."""
    if p.name in ("", ".", ".."):
        return p / f"model{suffix}"
    return p.with_suffix(suffix)


def _kind(path: Path) -> str | None:
    """'sidecar' (M.onnx.json / M.engine.json), 'onnx', 'engine' or None, by name."""
    name = path.name.lower()
    if name.endswith(SIDECAR_SUFFIX) and Path(name[:-len(SIDECAR_SUFFIX)]).suffix in (
            ONNX_SUFFIXES + ENGINE_SUFFIXES):
        return "sidecar"
    suffix = path.suffix.lower()
    if suffix in ONNX_SUFFIXES:
        return "onnx"
    if suffix in ENGINE_SUFFIXES:
        return "engine"
    return None


def onnx_model(path: str | os.PathLike, *, command: str, flag: str = "MODEL.onnx") -> Path:
    """An existing ONNX model for ``qkrope <command>``."""
    p = Path(path)
    kind = _kind(p)
    if kind == "sidecar":
        model = p.with_name(p.name[:-len(SIDECAR_SUFFIX)])
        raise InputError(f"{p} is the JSON sidecar of {model.name}, not a model. Fix: qkrope "
                         f"{command} {model}")
    if kind == "engine":
        raise InputError(f"{p} is a TensorRT engine; qkrope {command} takes the ONNX model "
                         f"`qkrope export` wrote (the engine's sidecar names it). Fix: qkrope "
                         f"{command} MODEL.onnx")
    _exists(p, flag, f"export it with `qkrope export --out {_with_suffix(p, '.onnx')}`")
    return p


def engine(path: str | os.PathLike, *, command: str, flag: str = "MODEL.engine",
           refit: bool = False, onnx_ok: bool = False) -> Path:
    """An existing TensorRT engine for ``qkrope <command>``. ``onnx_ok``: an existing ``.onnx``
    passes, for the commands whose next check reads it (its QKNormRoPE nodes against the node
    contract, then "not a TensorRT engine")."""
    p = Path(path)
    kind = _kind(p)
    build = (f"qkrope build {_with_suffix(p, '.onnx') if kind != 'onnx' else p}"
             f"{' --refit' if refit else ''} -o {_with_suffix(p, '.engine')}")
    if kind == "sidecar":
        model = p.with_name(p.name[:-len(SIDECAR_SUFFIX)])
        raise InputError(f"{p} is the JSON sidecar of {model.name}, not an engine. Fix: qkrope "
                         f"{command} {model}")
    if kind == "onnx" and onnx_ok and p.is_file():
        return p
    if kind == "onnx":
        raise InputError(f"{p} is an ONNX model, not a TensorRT engine; qkrope {command} takes "
                         f"an engine"
                         f"{' built with `qkrope build --refit`' if refit else ''}. Fix: {build}, "
                         f"then qkrope {command} {_with_suffix(p, '.engine')}")
    _exists(p, flag, f"build it with `{build}`")
    return p


def input_file(path: str | os.PathLike | None, *, flag: str, fix: str) -> Path | None:
    """An existing file given with ``flag`` (None passes)."""
    if path is None:
        return None
    p = Path(path)
    _exists(p, flag, fix)
    return p


def input_dir(path: str | os.PathLike | None, *, flag: str, fix: str) -> Path | None:
    """An existing folder given with ``flag`` (None passes)."""
    if path is None:
        return None
    p = Path(path)
    if not p.exists():
        from qkrope._fileio import recover

        if not recover(p):  # a writer killed mid-commit had moved the folder away: put back
            raise InputFileNotFoundError(f"{flag} {p} does not exist. Fix: {fix}")
    if not p.is_dir():
        raise InputError(f"{flag} {p} is a file, not a folder. Fix: {fix}")
    return p


def file_to_write(path: str | os.PathLike | None, *, flag: str,
                  example: str = "FILE") -> Path | None:
    """A file a command writes (an output, a cache it reads and rewrites): not a folder (the
    writers check the folder it goes to). ``example``: a file name to suggest inside a folder
    given instead."""
    if path is None:
        return None
    p = Path(path)
    if p.is_dir():
        raise InputError(f"{flag} {p} is a folder; it takes a file. Fix: {flag} "
                         f"{p / example}")
    return p


def _exists(p: Path, flag: str, fix: str) -> None:
    if not p.exists():
        raise InputFileNotFoundError(f"{flag} {p} does not exist. Fix: {fix}"
                                     if flag.startswith("-") else f"{p} does not exist. Fix: {fix}")
    if p.is_dir():
        raise InputError(f"{p} is a folder, not a file. Fix: {fix}")
