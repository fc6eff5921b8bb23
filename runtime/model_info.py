"""The exporter's sidecar ``<model>.onnx.json``: schema, loading, saving, and sample inputs.

``qkrope export`` writes it next to every model; ``qkrope build``, ``qkrope check``, the Triton
repository writer and the runtime wrapper read it through :class:`ModelInfo`. Schema
``"format": "qkrope-onnx/1"`` (stable; a new incompatible layout gets a new format string)::

    {
      "format": "qkrope-onnx/1",
      "model": "attention" | "transformer",
      "opset": 18, "ir_version": 10,
      "dtype": "fp32" | "fp16" | "bf16",                 # weights and activations
      "inputs":  [{"name": str, "dtype": "float32"|"float16"|"bfloat16"|"bool"|...,
                   "shape": [int | axis-name str, ...]}, ...],   # graph order
      "outputs": [same],
      "dynamic_axes": {"batch": {"export_value": 2}, "img_tokens": {...}, "txt_tokens": {...},
                       "img_cache_rows": {...}, "txt_cache_rows": {...}},
      "node_attributes": {"epsilon": 1e-06, "interleaved": 1, "rounding": 0,
                          "plugin_version": "1", "plugin_namespace": "qkrope"},
      "config": {"dim", "heads", "head_dim", "eps", "interleaved", "rounding", "rotary_dim",
                 "axes_dims_rope", "seed", "weights" (path or null), "weights_sha256",
                 ... transformers add "diffusers_dir", "diffusers_config" (the model's config
                 dict) and "num_layers_exported"},
      "sample": {"img_shapes": [[f, h, w], ...], "txt_len": int, "batch": int},
      "versions": {"qkrope", "torch", "onnx", "onnxscript", "onnxruntime"?, "diffusers"?}
    }

Dtype names are numpy's (``"bfloat16"`` is ml_dtypes' name). **bfloat16 arrays**: numpy has no
bfloat16, so :meth:`ModelInfo.make_inputs` returns ``ml_dtypes.bfloat16`` arrays (ml_dtypes is a
dependency of onnx, so it is always installed; ``onnx.numpy_helper`` uses the same type). Use
:func:`to_torch` for a torch tensor (exact) and :func:`to_ort_value` for ONNX Runtime, whose
``InferenceSession.run`` rejects ml_dtypes arrays but accepts an ``OrtValue`` built from the raw
16-bit pattern. polygraphy 0.53's ONNX Runtime runner rejects bfloat16 inputs of every kind, which
is why ``qkrope check`` runs bf16 models through its own thin OrtValue runner.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from qkrope.errors import InputError, QkropeError
from qkrope._fileio import write_text_atomic

from qkrope import dtypes

FORMAT = "qkrope-onnx/1"
MODELS = ("attention", "transformer")
DTYPES = dtypes.NAME_BY_SHORT  # --dtype -> numpy name (the one table, in runtime/dtypes.py)
AXES = ("batch", "img_tokens", "txt_tokens", "img_cache_rows", "txt_cache_rows")


class ModelInfoError(QkropeError, ValueError):
    """The sidecar is missing, unreadable or not in this schema."""


def sidecar_path(onnx_path: str | os.PathLike) -> Path:
    """``model.onnx`` -> ``model.onnx.json``."""
    return Path(str(onnx_path) + ".json")


def numpy_dtype(name: str) -> np.dtype:
    """A numpy dtype from its name, ``"bfloat16"`` included (ml_dtypes)."""
    return dtypes.numpy_dtype(name)


def to_torch(array: np.ndarray):
    """numpy (ml_dtypes bfloat16 included) -> torch tensor, exactly."""
    import torch

    if array.dtype.name == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(array).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(array))


def from_torch(tensor) -> np.ndarray:
    """torch tensor -> numpy on the CPU; bfloat16 becomes an ml_dtypes bfloat16 array, exactly."""
    import torch

    t = tensor.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(numpy_dtype("bfloat16"))
    return t.numpy()


def to_ort_value(array: np.ndarray):
    """An ``onnxruntime.OrtValue`` for any input array, bfloat16 (ml_dtypes) included."""
    import onnxruntime as ort
    from onnx import TensorProto

    if array.dtype.name == "bfloat16":
        return ort.OrtValue.ortvalue_from_numpy_with_onnx_type(
            np.ascontiguousarray(array).view(np.uint16), TensorProto.BFLOAT16)
    return ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(array))


def from_ort_value(value) -> np.ndarray:
    """An ``onnxruntime.OrtValue`` (CPU) -> numpy; bfloat16 -> ml_dtypes bfloat16 (ORT's own
    ``OrtValue.numpy()`` raises for bfloat16, so the bytes are copied from its buffer)."""
    if value.data_type() != "tensor(bfloat16)":
        return np.asarray(value.numpy())
    import ctypes

    if value.device_name().lower() != "cpu":
        raise InputError("from_ort_value reads bfloat16 OrtValues from CPU memory only")
    shape = tuple(value.shape())
    count = int(np.prod(shape)) if shape else 1
    buf = (ctypes.c_uint16 * count).from_address(value.data_ptr())
    return np.ctypeslib.as_array(buf).copy().reshape(shape).view(numpy_dtype("bfloat16"))


@dataclass
class TensorInfo:
    name: str
    dtype: str
    shape: list  # int or axis name

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "TensorInfo":
        return cls(str(d["name"]), str(d["dtype"]), list(d["shape"]))


@dataclass
class ModelInfo:
    """One exported model's description (see the module docstring for the JSON schema)."""

    model: str
    opset: int
    ir_version: int
    dtype: str
    inputs: list[TensorInfo]
    outputs: list[TensorInfo]
    dynamic_axes: dict[str, dict[str, int]]
    node_attributes: dict[str, Any]
    config: dict[str, Any]
    sample: dict[str, Any]
    versions: dict[str, str] = field(default_factory=dict)
    format: str = FORMAT

    # ---------------------------------------------------------------- (de)serialisation
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        return {"format": d.pop("format"), **d}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, source: str = "<dict>") -> "ModelInfo":
        if d.get("format") != FORMAT:
            raise ModelInfoError(f"{source} is not a qkrope sidecar of format {FORMAT!r} (got "
                                 f"format={d.get('format')!r}). Fix: re-export with `qkrope "
                                 f"export`.")
        try:
            info = cls(
                model=str(d["model"]), opset=int(d["opset"]), ir_version=int(d["ir_version"]),
                dtype=str(d["dtype"]),
                inputs=[TensorInfo.from_dict(t) for t in d["inputs"]],
                outputs=[TensorInfo.from_dict(t) for t in d["outputs"]],
                dynamic_axes={k: {"export_value": int(v["export_value"])}
                              for k, v in d["dynamic_axes"].items()},
                node_attributes=dict(d["node_attributes"]), config=dict(d["config"]),
                sample=dict(d["sample"]), versions=dict(d.get("versions", {})))
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelInfoError(f"{source} is missing or has a malformed field ({exc!r}). Fix: "
                                 f"re-export with `qkrope export`.") from None
        if info.model not in MODELS or info.dtype not in DTYPES:
            raise ModelInfoError(f"{source}: unknown model {info.model!r} or dtype {info.dtype!r}")
        return info

    @classmethod
    def load(cls, onnx_path: str | os.PathLike) -> "ModelInfo":
        """Read ``<onnx_path>.json``; a clear error when it is missing or invalid."""
        path = sidecar_path(onnx_path)
        if not path.is_file():
            raise ModelInfoError(
                f"no sidecar {path} next to {onnx_path}: qkrope reads model sizes, axes and the "
                f"source weights from it. Fix: export the model with `qkrope export --out "
                f"{onnx_path}`.")
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelInfoError(f"cannot read the sidecar {path}: {exc}. Fix: re-export with "
                                 f"`qkrope export`.") from None
        return cls.from_dict(data, source=str(path))

    def save(self, onnx_path: str | os.PathLike) -> Path:
        """Write ``<onnx_path>.json`` atomically (temp file + os.replace)."""
        path = sidecar_path(onnx_path)
        write_text_atomic(path, json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    # ---------------------------------------------------------------- shapes and inputs
    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.inputs]

    @property
    def output_names(self) -> list[str]:
        return [t.name for t in self.outputs]

    def tensor(self, name: str) -> TensorInfo:
        for t in self.inputs + self.outputs:
            if t.name == name:
                return t
        raise KeyError(f"{name!r} is not an input or output of this model; it has inputs "
                       f"{self.input_names} and outputs {self.output_names}")

    def input_shape(self, name: str, *, batch: int, img_tokens: int, txt_tokens: int,
                    img_cache_rows: int | None = None,
                    txt_cache_rows: int | None = None) -> tuple[int, ...]:
        """The concrete shape of input (or output) ``name`` for these sizes; cache rows default
        to the token counts."""
        values = {"batch": batch, "img_tokens": img_tokens, "txt_tokens": txt_tokens,
                  "img_cache_rows": img_tokens if img_cache_rows is None else img_cache_rows,
                  "txt_cache_rows": txt_tokens if txt_cache_rows is None else txt_cache_rows}
        out = []
        for d in self.tensor(name).shape:
            if isinstance(d, str):
                if d not in values:
                    raise ModelInfoError(f"{name}: unknown axis name {d!r}")
                out.append(int(values[d]))
            else:
                out.append(int(d))
        return tuple(out)

    def axes_dims_rope(self) -> tuple[int, int, int]:
        return tuple(int(v) for v in self.config["axes_dims_rope"])  # type: ignore[return-value]

    def make_inputs(self, img_shapes: Sequence[Sequence[int]] | None = None,
                    txt_len: int | None = None, batch: int | None = None,
                    seed: int = 0) -> dict[str, np.ndarray]:
        """Deterministic inputs for every graph input (in graph order) for these sizes (default:
        the export sample): activations ~ N(0, 1) in the model dtype, a text mask with the last
        quarter of the second batch item's tokens masked (all ones for batch 1), timesteps in
        (0, 1), and the correct Qwen-Image caches from build_qwen_rope_caches."""
        from qkrope.runtime.caches import build_qwen_rope_caches

        img_shapes = [tuple(int(v) for v in s) for s in (img_shapes or self.sample["img_shapes"])]
        txt_len = int(txt_len or self.sample["txt_len"])
        batch = int(batch or self.sample["batch"])
        img_tokens = sum(f * h * w for f, h, w in img_shapes)
        caches = build_qwen_rope_caches(img_shapes, txt_len, axes_dim=self.axes_dims_rope())
        rng = np.random.default_rng(seed)
        sizes = dict(batch=batch, img_tokens=img_tokens, txt_tokens=txt_len)
        feeds: dict[str, np.ndarray] = {}
        for t in self.inputs:
            dtype = numpy_dtype(t.dtype)
            if t.name == "img_cos_sin_cache":
                feeds[t.name] = caches.img.numpy().copy()
            elif t.name == "txt_cos_sin_cache":
                feeds[t.name] = caches.txt.numpy().copy()
            elif t.name == "encoder_hidden_states_mask":
                mask = np.ones(self.input_shape(t.name, **sizes), dtype=bool)
                if batch > 1 and txt_len > 1:
                    mask[1, txt_len - max(1, txt_len // 4):] = False
                feeds[t.name] = mask.astype(dtype)
            elif t.name == "timestep":
                feeds[t.name] = rng.uniform(0.05, 0.95, self.input_shape(t.name, **sizes)).astype(
                    np.float32).astype(dtype)
            else:
                feeds[t.name] = rng.standard_normal(self.input_shape(t.name, **sizes)).astype(
                    np.float32).astype(dtype)
        return feeds
