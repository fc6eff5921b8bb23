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


def _whole(value, low: int = 1) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _one_of(choices):
    return lambda v: isinstance(v, str) and v in choices


def _img_shapes(value) -> bool:
    return (isinstance(value, (list, tuple)) and len(value) > 0 and all(
        isinstance(s, (list, tuple)) and len(s) == 3 and all(_whole(d) for d in s)
        for s in value))


def _path(value) -> bool:
    return isinstance(value, (str, os.PathLike)) and str(value) != ""


#: what each argument of :func:`export_transformer` takes (None passes where the default is
#: None): (the check, what a user reads). The one home of these checks; the command's parser
#: gives the same values, and its flags' names are in the messages.
ARGUMENTS = {
    "diffusers_dir": (_path, "the path of a saved diffusers transformer folder (str or "
                             "os.PathLike)"),
    "out": (lambda v: _path(v) and str(v).lower().endswith(".onnx"),
            "the path of the .onnx to write (str or os.PathLike ending in .onnx)"),
    "dtype": (lambda v: isinstance(v, str) and v in _dtype_names(), "one of fp32, fp16, bf16"),
    # the values of layers and opset are the command's checks (check_family_options, the
    # exporter's opset range); their type is checked here
    "layers": (lambda v: _whole(v, low=-2**63), "a number of blocks, an int"),
    "opset": (lambda v: _whole(v, low=-2**63),
              f"an int opset ({contract.MIN_OPSET}..{contract.MAX_OPSET})"),
    "rounding": (lambda v: _whole(v, 0) and v in contract.ROUNDING_MODES,
                 f"one of the ints {', '.join(map(str, contract.ROUNDING_MODES))}"),
    "attention": (_one_of(contract.ATTENTION_FORMS),
                  f"one of {', '.join(map(repr, contract.ATTENTION_FORMS))}"),
    "img_shapes": (_img_shapes, "a list of (frames, height, width) triples of ints >= 1"),
    "txt_len": (_whole, "a number of text tokens, an int >= 1"),
    "batch": (_whole, "a batch size, an int >= 1"),
    "quant": (lambda v: isinstance(v, str) and v in _quant_modes(), "'fp8' or None"),
    "variant": (lambda v: isinstance(v, str) and v != "", "a weights variant name (str, e.g. "
                                                           "'fp16')"),
    "progress": (lambda v: isinstance(v, bool), "True or False"),
}
#: the command's flag of each argument, for the messages
FLAGS = {"diffusers_dir": "--diffusers", "out": "--out", "img_shapes": "--img-shape",
         "txt_len": "--txt-len"}


def _dtype_names():
    from qkrope import dtypes

    return dtypes.NAME_BY_SHORT


def _quant_modes():
    from qkrope import quantization

    return quantization.QUANT_MODES


def check_arguments(**arguments) -> None:
    """Each argument of :func:`export_transformer` is what :data:`ARGUMENTS` says it takes
    (None where its default is None): else an :class:`qkrope.errors.InputError` in one line
    naming the argument, what it got and what it takes."""
    from qkrope.errors import InputError

    for name, value in arguments.items():
        if value is None and (name in DEFAULTS and DEFAULTS[name] is None or name == "out"):
            continue
        check, takes = ARGUMENTS[name]
        try:
            ok = bool(check(value))
        except Exception:  # noqa: BLE001 - an object whose comparison fails is refused too
            ok = False
        if not ok:
            shown = repr(value)
            shown = shown if len(shown) <= 80 else shown[:77] + "..."
            flag = FLAGS.get(name, "--" + name.replace("_", "-"))
            raise InputError(f"export_transformer({name}=...) ({flag}) takes {takes}; got "
                             f"{type(value).__name__} {shown}. Fix: pass {name} as {takes}")


def check_family_options(record, diffusers_dir: str | os.PathLike, layers) -> None:
    """The options that depend on the family (``layers``: within the model's blocks, through
    :func:`qkrope.families.check_blocks_option` with the folder's config.json), checked before
    the export starts: the one check of the command and the Python API."""
    if layers is None:
        return
    import json

    from qkrope import families
    from qkrope.diffusers_weights import transformer_folder

    with open(os.path.join(transformer_folder(str(diffusers_dir)), "config.json"),
              encoding="utf-8") as fh:  # read (and checked) by folder_family already
        config = json.load(fh)
    families.check_blocks_option(record, "--layers", layers, config=config, cut=True)


def check_paths(diffusers_dir: str | os.PathLike, out: str | os.PathLike | None,
                variant: str | None) -> None:
    """The paths' facts, before any work, as :class:`qkrope.errors.InputError` in one line:
    ``out`` not a folder, and its folder one that can be written (no path component a file);
    ``variant``: the folder holds that variant's weights. The writers' and the weight reader's
    own errors (``OutputWriteError``, ``DiffusersWeightsError``) say the same of a folder that
    changes later; at this boundary a bad argument is an InputError."""
    from qkrope import _preflight as pre
    from qkrope._fileio import OutputWriteError, check_output_folder
    from qkrope.diffusers_weights import (DiffusersWeightsError, _variants_present,
                                          model_folder, weight_files)
    from qkrope.errors import InputError

    if out is not None:
        pre.file_to_write(out, flag="--out", example="model.onnx")
        try:
            check_output_folder(Path(out).parent, flag="--out")
        except OutputWriteError as exc:
            raise InputError(f"--out {out}: {exc.strerror or exc}") from None
    if variant is not None:
        folder = model_folder(diffusers_dir)
        if variant not in _variants_present(folder):
            try:  # its one-line refusal, naming what the folder holds
                weight_files(folder, variant=variant)
            except DiffusersWeightsError as exc:
                raise InputError(str(exc)) from None


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

    Bad input raises :class:`qkrope.errors.InputError` (one line with the fix) before any work:
    an argument of another type or outside its values (:data:`ARGUMENTS`: a str for
    ``layers``, a bool where an int is wanted, a list for ``dtype``, ...), and ``layers`` past
    the model's blocks, refused by the same check as the command's
    (:func:`check_family_options`); an ``out`` that is a folder or lies under a file, and a
    ``variant`` whose weights the folder does not hold (:func:`check_paths`).
    """
    from qkrope import _preflight as pre

    check_arguments(diffusers_dir=diffusers_dir, out=out, dtype=dtype, layers=layers,
                    opset=opset, rounding=rounding, attention=attention, img_shapes=img_shapes,
                    txt_len=txt_len, batch=batch, quant=quant, variant=variant,
                    progress=progress)
    pre.input_dir(str(diffusers_dir), flag="--diffusers",
                  fix="pass the local folder of a saved diffusers transformer (config.json "
                      "and its weights; nothing is downloaded)")
    check_paths(diffusers_dir, out, variant)
    from qkrope.export.patch_diffusers import folder_family

    # another model class: refused (with the list) first; then the family's options
    check_family_options(folder_family(str(diffusers_dir)), diffusers_dir, layers)
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


__all__ = ["ARGUMENTS", "DEFAULTS", "DtypeChoice", "ExportResult", "check_arguments",
           "check_family_options", "check_paths", "checkpoint_dtype", "default_out",
           "export_transformer", "resolve_dtype"]
