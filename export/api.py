"""The transformer export as a Python function: :func:`export_transformer`, the one home of the
defaults ``qkrope export --model transformer`` uses (the command passes None for every option it
was not given).

    from qkrope.export import export_transformer

    result = export_transformer("FLUX.1-dev/transformer", layers=2)
    print(result.dtype, result.dtype_reason, result.paths)

The dtype default is the checkpoint's (:func:`qkrope.export.checkpoint_dtype.checkpoint_dtype`:
the dtype the weights are stored in; a mixed folder's majority).

Importing this module imports neither torch nor diffusers; :func:`export_transformer` does.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from qkrope import contract

from .checkpoint_dtype import DtypeChoice, checkpoint_dtype, resolve_dtype

#: the option defaults of ``qkrope export --model transformer`` and :func:`export_transformer`
#: (None: decided from the folder or by the exporter: the checkpoint's dtype, every block, the
#: opset of the attention form, the family's rounding, the exporter's sample)
DEFAULTS = {"dtype": None, "layers": None, "opset": None, "rounding": None,
            "attention": contract.DEFAULT_ATTENTION_FORM, "img_shapes": None, "txt_len": None,
            "batch": None, "quant": None, "variant": None}


def default_out(diffusers_dir: str | os.PathLike, dtype: str) -> Path:
    """``<family>_transformer_<dtype>.onnx`` in the working folder (the family's folder name,
    from config.json: :mod:`qkrope.families`)."""
    from qkrope.export.patch_diffusers import folder_family

    prefix = folder_family(str(diffusers_dir)).name.replace("-", "_")
    return Path(f"{prefix}_transformer_{dtype}.onnx")


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_transformer` wrote: ``paths`` (the model, its external data when it
    has any, its sidecar), the sidecar's :class:`qkrope.sidecars.ModelInfo` (``info``), the
    dtype and why it was chosen."""

    out: Path
    paths: tuple
    info: object
    dtype: str
    dtype_reason: str


def export_transformer(diffusers_dir: str | os.PathLike, out: str | os.PathLike | None = None,
                       *, dtype: str | None = DEFAULTS["dtype"],
                       layers: int | None = DEFAULTS["layers"],
                       opset: int | None = DEFAULTS["opset"],
                       rounding: int | None = DEFAULTS["rounding"],
                       attention: str = DEFAULTS["attention"],
                       img_shapes: Sequence[Sequence[int]] | None = DEFAULTS["img_shapes"],
                       txt_len: int | None = DEFAULTS["txt_len"],
                       batch: int | None = DEFAULTS["batch"],
                       quant: str | None = DEFAULTS["quant"],
                       variant: str | None = DEFAULTS["variant"],
                       progress: bool = True) -> ExportResult:
    """Export the saved diffusers transformer in ``diffusers_dir`` (any family of
    :mod:`qkrope.families`; nothing is downloaded) to ONNX with QKNormRoPE nodes, as ``qkrope
    export --model transformer --diffusers DIR`` does, streamed (the weights are read from the
    shards one tensor at a time).

    - ``out``: the .onnx to write (default ``<family>_transformer_<dtype>.onnx`` in the working
      folder); its external data (``.onnx.data``, over 1.5 GiB of weights) and sidecar
      (``.onnx.json``) go beside it.
    - ``dtype``: ``"fp32"``, ``"fp16"`` or ``"bf16"``; None: the checkpoint's
      (:func:`checkpoint_dtype`). The choice and its reason are printed (with ``progress``) and
      returned.
    - ``layers``: keep the first N blocks (families whose record has ``blocks``); ``opset``,
      ``attention`` (``"primitive"`` or ``"onnx23"``), ``rounding`` (0, 1, 2; None: the family's),
      ``img_shapes`` (``[(F, H, W), ...]`` in latent patches), ``txt_len`` and ``batch``: the
      trace's sample; ``quant="fp8"``: a folder quantised by ``qkrope quantize``; ``variant``:
      diffusers' weights variant (``"fp16"``).
    - ``progress``: the steps on stderr (tqdm on a terminal, lines in a log).

    Bad input raises :class:`qkrope.errors.InputError` (one line with the fix) before any work.
    """
    from qkrope import _preflight as pre

    pre.input_dir(str(diffusers_dir), flag="--diffusers",
                  fix="pass the local folder of a saved diffusers transformer (config.json "
                      "and its weights; nothing is downloaded)")
    from qkrope.export.patch_diffusers import folder_family

    folder_family(str(diffusers_dir))  # another model class: refused (with the list) first
    choice = resolve_dtype(dtype, diffusers_dir, variant=variant)
    if progress:
        print(f"qkrope export: dtype {choice.dtype}: {choice.reason}", file=sys.stderr,
              flush=True)
    out = Path(out) if out is not None else default_out(diffusers_dir, choice.dtype)

    from qkrope.export import onnx_export  # torch, onnx, onnxscript: only when exporting

    info, written = onnx_export.export_transformer(
        out, diffusers_dir, layers=layers, dtype=choice.dtype, opset=opset, rounding=rounding,
        img_shapes=img_shapes, txt_len=txt_len, batch=batch, attention=attention,
        progress=progress, quant=quant, variant=variant)
    return ExportResult(out=out, paths=tuple(written), info=info, dtype=choice.dtype,
                        dtype_reason=choice.reason)


__all__ = ["DEFAULTS", "DtypeChoice", "ExportResult", "checkpoint_dtype", "default_out",
           "export_transformer", "resolve_dtype"]
