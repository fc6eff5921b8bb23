"""A polygraphy data-loader script that feeds real inputs to a qkrope model.

polygraphy's default data loader fills every input with random values, so a model whose RoPE
caches are inputs "passes" a comparison on meaningless caches. This script gives polygraphy the
inputs qkrope itself checks with (:func:`qkrope.runtime.inputs.make_inputs`, by the sidecar's
family): the correct caches (from the positions the family's pipelines pass, by its position
scheme) and deterministic activations and the other inputs its graph has (mask, timestep,
pooled projections, guidance) for the sizes of the export sample (from the model's
sidecar)::

    polygraphy run M.onnx --onnxrt \\
        --data-loader-script "$(python -m qkrope.apps.polygraphy_data_loader)"
    polygraphy run M.onnx --trt --onnxrt --plugins build/plugins/libqkrope_plugin.so \\
        --data-loader-script "$(python -m qkrope.apps.polygraphy_data_loader)"

``python -m qkrope.apps.polygraphy_data_loader`` prints this file's path. polygraphy calls
``load_data()`` without arguments; the model is found in polygraphy's own command line (the first
``.onnx`` argument; for an ``.engine``/``.plan`` argument, the ONNX file its sidecar names) or in
``QKROPE_MODEL``. ``QKROPE_IMG_SHAPES`` (e.g. ``1x32x32``, several joined by ``,``),
``QKROPE_TXT_LEN``, ``QKROPE_BATCH`` and ``QKROPE_SEED`` override the sample sizes.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Iterator, Sequence

from qkrope.errors import InputError

_MODEL_SUFFIXES = (".onnx",)
_ENGINE_SUFFIXES = (".engine", ".plan")


def find_model(argv: Sequence[str] | None = None) -> Path:
    """The ONNX model polygraphy was asked to run (QKROPE_MODEL, else the command line)."""
    explicit = os.environ.get("QKROPE_MODEL")
    if explicit:
        return _onnx_of(Path(explicit))
    for arg in (sys.argv if argv is None else argv)[1:]:
        if arg.lower().endswith(_MODEL_SUFFIXES + _ENGINE_SUFFIXES) and Path(arg).is_file():
            return _onnx_of(Path(arg))
    raise InputError("the qkrope data loader cannot tell which model polygraphy runs: no .onnx or "
                     ".engine file in its command line. Fix: set QKROPE_MODEL=path/to/M.onnx")


def _onnx_of(path: Path) -> Path:
    if path.suffix.lower() in _ENGINE_SUFFIXES:
        from qkrope.sidecars import EngineInfo

        return Path(EngineInfo.load(path).onnx)
    return path


def _img_shapes(text: str) -> list[tuple[int, int, int]]:
    try:
        shapes = [tuple(int(v) for v in part.split("x")) for part in text.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 3 for s in shapes):
        raise InputError(f"QKROPE_IMG_SHAPES must be FxHxW triples joined by ',' (e.g. 1x32x32); "
                         f"got {text!r}")
    return shapes  # type: ignore[return-value]


def env_int(name: str, *, minimum: int | None = 1) -> int | None:
    """The integer in environment variable ``name`` (unset or empty: None), at least
    ``minimum``; anything else is one line naming the variable, the value and the fix (``0``
    is refused, not taken for "unset")."""
    text = os.environ.get(name, "").strip()
    if not text:
        return None
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or (minimum is not None and value < minimum):
        want = "an integer" if minimum is None else f"an integer >= {minimum}"
        raise InputError(f"{name} must be {want}; got {os.environ[name]!r}. Fix: e.g. "
                         f"{name}={max(minimum or 0, 2)}, or unset it for the export sample's")
    return value


def load_data() -> Iterator[dict]:
    """polygraphy's entry point: one feed dict of the model's inputs."""
    from qkrope.runtime.inputs import make_inputs
    from qkrope.sidecars import ModelInfo

    txt_len, batch = env_int("QKROPE_TXT_LEN"), env_int("QKROPE_BATCH")
    seed = env_int("QKROPE_SEED", minimum=0) or 0
    env = os.environ
    shapes = _img_shapes(env["QKROPE_IMG_SHAPES"]) if env.get("QKROPE_IMG_SHAPES") else None
    info = ModelInfo.load(find_model())
    yield make_inputs(info, shapes, txt_len, batch, seed=seed)


if __name__ == "__main__":
    print(Path(__file__).resolve())
