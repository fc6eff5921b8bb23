"""The sidecars' formats (names, versions), their errors and their paths beside the model and
the engine, and the fix texts the errors end with."""

from __future__ import annotations

import os
from pathlib import Path

from qkrope import dtypes, model_io
from qkrope.errors import QkropeError

# The version written. 2: each tensor records its role; the node attributes (epsilon,
# interleaved, rounding) are stored once, in node_attributes, no longer in config too.
FORMAT_VERSION = 2
READ_VERSIONS = (1, 2)  # a version 1 sidecar is read: its roles are guessed from the names
ONNX_FORMAT = "qkrope-onnx"
ENGINE_FORMAT = "qkrope-engine"
MODELS = tuple(model_io.MODELS)
DTYPES = dtypes.NAME_BY_SHORT  # --dtype -> numpy name (the one table, qkrope/dtypes.py)
AXES = model_io.AXES
LEVELS = ("min", "opt", "max")


class SidecarError(QkropeError, ValueError):
    """A sidecar is missing, unreadable, or not in its schema; the message names the file."""


class ModelInfoError(SidecarError):
    """The ONNX sidecar ``M.onnx.json`` is missing, unreadable or not in this schema."""


class EngineInfoError(SidecarError):
    """The engine sidecar ``M.engine.json`` is missing, unreadable or not in this schema."""


def sidecar_path(onnx_path: str | os.PathLike) -> Path:
    """``model.onnx`` -> ``model.onnx.json``."""
    return Path(str(onnx_path) + ".json")


def engine_sidecar_path(engine_path: str | os.PathLike) -> Path:
    """``model.engine`` -> ``model.engine.json``."""
    return Path(str(engine_path) + ".json")


METADATA_PREFIX = "qkrope."  # the export's metadata_props keys: qkrope.model, .dtype, .config
_ONNX_FIX = "re-export with `qkrope export`"
_ENGINE_FIX = "rebuild the engine with `qkrope build` (it writes the sidecar next to the engine)"
