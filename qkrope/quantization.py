"""Quantised models: how qkrope recognises ModelOpt quantizer state and what it records.

NVIDIA ModelOpt (``nvidia-modelopt``) quantises a PyTorch model by giving each quantised module
``TensorQuantizer`` children (``input_quantizer``, ``weight_quantizer``, ...) whose calibrated
ranges are buffers: a state dict of a quantised model carries keys such as
``transformer_blocks.0.attn.to_q.input_quantizer._amax``. ``save_pretrained`` writes them into the
safetensors files and, with ModelOpt's Hugging Face checkpointing enabled, the quantizer
configuration into ``modelopt_state.pth`` beside them. diffusers' ``from_pretrained`` ignores
both, so a quantised folder would load (and export) as a plain float model: every reader of
weights in qkrope asks :func:`quantizer_keys` / :func:`folder_quantization` first and refuses
(:class:`QuantizedModelError`, naming the command that handles the quantisation) instead.

This module imports nothing heavy (safetensors headers are read as JSON; torch only for a
``.bin`` state dict), so it sits below ``runtime/`` and ``export/``.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from qkrope.errors import InputError

#: The part of a state-dict key that marks a ModelOpt TensorQuantizer buffer
#: (``<module>.<role>_quantizer._amax``, ``._pre_quant_scale``, ``._bias_value``, ...).
QUANTIZER_MARK = "_quantizer."
#: The file ModelOpt's Hugging Face checkpointing writes beside the weights.
MODELOPT_STATE_FILE = "modelopt_state.pth"
#: Quantisation modes of ``qkrope quantize`` / ``qkrope export --quant``.
QUANT_MODES = ("fp8",)

def default_excluded(model: object) -> tuple[str, ...]:
    """The default ``--exclude`` of a diffusers transformer (an instance, its class or its class
    name): its family record's ``fp8_excluded`` (:mod:`qkrope.families`), and for an instance
    the record's ``fp8_excluded_where_built`` that it has as modules (a config flag builds
    them); any other class is refused with the list."""
    from qkrope import families

    name = model if isinstance(model, str) else (model if isinstance(model, type)
                                                 else type(model)).__name__
    record = families.by_class(name)
    if record is None:
        raise InputError(f"no default FP8 layer selection for {name}: qkrope knows "
                         f"{', '.join(r.class_name for r in families.records())}. Fix: pass "
                         f"the top-level modules to keep in high precision with --exclude")
    if isinstance(model, (str, type)) or not hasattr(model, "named_children"):
        return record.fp8_excluded
    built = {n for n, _ in model.named_children()}
    return record.fp8_excluded + tuple(n for n in record.fp8_excluded_where_built if n in built)


def __getattr__(name: str):
    # Old names of the family facts, now in the family records (qkrope.families).
    from qkrope import families

    if name == "DEFAULT_EXCLUDED_BY_CLASS":
        return {r.class_name: r.fp8_excluded for r in families.records()}
    if name == "DEFAULT_EXCLUDED":  # the default of the export API's exclude: the first family's
        return families.default().fp8_excluded
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

#: Largest finite float8 e4m3fn value: the amax of a tensor maps to it (scale = amax / 448).
FP8_E4M3_MAX = 448.0
#: metadata_props key (after the exporter's ``qkrope.`` prefix) and sidecar config key.
METADATA_KEY = "quantization"

#: The ONNX file's metadata_props key that records the quantisation (JSON; also in the sidecar's
#: config under METADATA_KEY).
METADATA_PROP = "qkrope." + METADATA_KEY
#: ONNX Runtime session option an FP8 Q/DQ model needs on the CPU: with the default graph
#: optimisations ONNX Runtime 1.31 fuses the Q/DQ around MatMul into MatMulIntegerToFloat, which
#: has no float8 kernel, and the session fails (INVALID_GRAPH); with it the Q/DQ run as written.
ORT_QDQ_OPTION = ("session.disable_quant_qdq", "1")

QUANTIZE_COMMAND = ("qkrope quantize --diffusers DIR --calibration CALIB.pt --out QDIR")
EXPORT_COMMAND = "qkrope export --model transformer --diffusers {dir} --quant fp8"


class QuantizedModelError(InputError):
    """Weights carry quantizer state that the requested operation would silently drop."""


def quantizer_keys(keys: Iterable[str]) -> list[str]:
    """The keys of ModelOpt quantizer buffers among state-dict ``keys`` (in their order)."""
    return [k for k in keys if QUANTIZER_MARK in k]


def _safetensors_keys(path: Path) -> list[str]:
    """The tensor names of a safetensors file, from its JSON header (8-byte little-endian
    length, then the header); no tensor is read."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) != 8:
            raise InputError(f"{path} is not a safetensors file (shorter than its header)")
        (n,) = struct.unpack("<Q", head)
        if n > 100 * 2**20:
            raise InputError(f"{path} is not a safetensors file (header of {n} bytes)")
        try:
            header = json.loads(f.read(n))
        except (ValueError, RecursionError):
            raise InputError(f"{path} is not a safetensors file (unreadable header)") from None
    if not isinstance(header, dict):  # a header is a JSON object: tensor name -> its record
        raise InputError(f"{path} is not a safetensors file (its header is a JSON "
                         f"{type(header).__name__}, not an object)")
    return [k for k in header if k != "__metadata__"]


def state_file_keys(path: str | os.PathLike) -> list[str]:
    """The keys of a weights file: safetensors (header only) or a torch-saved state dict
    (``weights_only``: no pickled code runs). A file that is neither is an InputError naming it
    (never torch's own exception and advice)."""
    path = Path(path)
    if path.suffix == ".safetensors":
        return _safetensors_keys(path)
    import torch

    with open(path, "rb") as f:
        zipped = f.read(4) == b"PK\x03\x04"  # torch.save's zip archive: readable with mmap
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=zipped)
    except Exception as exc:  # noqa: BLE001 - every torch.load failure: not a state dict
        what = ("a torch zip archive that cannot be read: truncated or corrupt" if zipped else
                "no torch.save file, or one holding objects other than tensors")
        raise InputError(f"{path} is not a readable torch-saved state dict ({what}; "
                         f"{type(exc).__name__}). Fix: remove it from the folder, or save the "
                         f"model again with save_pretrained") from None
    return list(state) if isinstance(state, dict) else []


@dataclass(frozen=True)
class FolderQuantization:
    """What a diffusers model folder carries of ModelOpt quantisation."""

    directory: Path
    quantizer_keys: tuple[str, ...]
    state_file: Path | None  # modelopt_state.pth, where present

    @property
    def quantized(self) -> bool:
        return bool(self.quantizer_keys) or self.state_file is not None

    def describe(self) -> str:
        parts = []
        if self.quantizer_keys:
            parts.append(f"{len(self.quantizer_keys)} quantizer tensors such as "
                         f"{self.quantizer_keys[0]}")
        if self.state_file is not None:
            parts.append(f"ModelOpt's {MODELOPT_STATE_FILE}")
        return " and ".join(parts)


#: The weight files ``save_pretrained`` writes (and diffusers reads) in a model folder, any variant
#: or shard: other ``*.bin`` / ``*.safetensors`` files there are not the model's weights.
WEIGHT_FILE_GLOBS = ("diffusion_pytorch_model*.safetensors", "diffusion_pytorch_model*.bin")


def folder_quantization(directory: str | os.PathLike) -> FolderQuantization:
    """Scan a diffusers model folder's weight files (:data:`WEIGHT_FILE_GLOBS`) for quantizer
    keys and look for ``modelopt_state.pth``. Files of other names are not read: diffusers does
    not load them either."""
    d = Path(directory)
    keys: list[str] = []
    for f in [p for pattern in WEIGHT_FILE_GLOBS for p in sorted(d.glob(pattern))]:
        keys += quantizer_keys(state_file_keys(f))
    state = d / MODELOPT_STATE_FILE
    return FolderQuantization(d, tuple(keys), state if state.is_file() else None)


def check_folder(directory: str | os.PathLike, quant: str | None) -> FolderQuantization:
    """Refuse a quantised folder exported as a float model, and a quantised export of a folder
    ModelOpt cannot restore; returns what the folder carries."""
    q = folder_quantization(directory)
    if quant is not None and quant not in QUANT_MODES:
        raise InputError(f"--quant must be one of {list(QUANT_MODES)}; got {quant!r}")
    if quant is None and q.quantized:
        raise QuantizedModelError(
            f"{directory} carries ModelOpt quantisation ({q.describe()}); a plain export would "
            f"drop it and write a float model. Fix: export it quantised with "
            f"`{EXPORT_COMMAND.format(dir=directory)}`")
    if quant is not None and q.state_file is None:
        found = (f"carries {q.describe()} but no {MODELOPT_STATE_FILE}" if q.quantized
                 else "is not quantised (no quantizer tensors, no "
                      f"{MODELOPT_STATE_FILE})")
        raise QuantizedModelError(
            f"--quant {quant} needs a folder saved by ModelOpt's checkpointing; {directory} "
            f"{found}. Fix: calibrate it with `{QUANTIZE_COMMAND}` and export QDIR")
    return q


def refuse_quantized_state_dict(keys: Iterable[str], *, source: str, fix: str) -> None:
    """Raise QuantizedModelError when a state dict's ``keys`` include quantizer buffers."""
    found = quantizer_keys(keys)
    if found:
        raise QuantizedModelError(
            f"{source} carries ModelOpt quantizer state ({len(found)} tensors such as "
            f"{found[0]}), which this operation would drop. Fix: {fix}")


def onnx_quantization(model) -> dict | None:
    """The quantisation record of an ONNX ModelProto (its ``qkrope.quantization``
    metadata_props entry), or None for a float model."""
    for prop in getattr(model, "metadata_props", ()):
        if prop.key == METADATA_PROP:
            try:
                return json.loads(prop.value)
            except ValueError as exc:
                raise InputError(f"the model's {METADATA_PROP} metadata is not JSON "
                                 f"({exc}); re-export it") from exc
    return None


def ort_session_options(model, session_options=None):
    """``session_options`` (a new ``onnxruntime.SessionOptions`` when None) with
    :data:`ORT_QDQ_OPTION` set when ``model`` (a ModelProto) is quantised; unchanged otherwise."""
    if onnx_quantization(model) is None:
        return session_options
    if session_options is None:
        import onnxruntime as ort

        session_options = ort.SessionOptions()
    session_options.add_session_config_entry(*ORT_QDQ_OPTION)
    return session_options


__all__ = ["METADATA_PROP", "ORT_QDQ_OPTION", "onnx_quantization", "ort_session_options",
           "QUANTIZER_MARK", "MODELOPT_STATE_FILE", "QUANT_MODES", "default_excluded",
           "FP8_E4M3_MAX",
           "QuantizedModelError", "quantizer_keys", "state_file_keys", "FolderQuantization",
           "folder_quantization", "check_folder", "refuse_quantized_state_dict"]
