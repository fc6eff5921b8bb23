"""Sample inputs for a described model, and exact array conversions between numpy, torch and
ONNX Runtime.

**bfloat16 arrays**: numpy has no bfloat16, so :func:`make_inputs` returns ``ml_dtypes.bfloat16``
arrays (ml_dtypes is a dependency of onnx, so it is always installed; ``onnx.numpy_helper`` uses
the same type). Use :func:`to_torch` for a torch tensor (exact) and :func:`to_ort_value` for ONNX
Runtime, whose ``InferenceSession.run`` rejects ml_dtypes arrays but accepts an ``OrtValue`` built
from the raw 16-bit pattern. polygraphy 0.53's ONNX Runtime runner rejects bfloat16 inputs of
every kind, which is why ``qkrope check`` runs bf16 models through its own thin OrtValue runner.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from qkrope import dtypes, model_io
from qkrope.errors import InputError
from qkrope.sidecars import ModelInfo

from . import rope_tables
from .caches import build_flux_rope_caches, build_qwen_rope_caches


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


def flux_family(info: ModelInfo) -> str | None:
    """The sidecar's FLUX family (``"flux1"`` / ``"flux2"``), None for any other model."""
    family = info.config.family
    return family if family in rope_tables.FLUX_FAMILIES else None


def flux_ids(info: ModelInfo, img_shapes: Sequence[Sequence[int]],
             txt_len: int) -> tuple[np.ndarray, np.ndarray]:
    """(txt_ids, img_ids) of a FLUX model for these sizes, as its pipelines lay them out
    (:func:`qkrope.runtime.rope_tables.flux_sample_ids`: the first image the output, the others
    condition / reference images)."""
    return rope_tables.flux_sample_ids(flux_family(info), img_shapes, txt_len)


def flux_rope_setting(info: ModelInfo) -> tuple[tuple[int, ...], float]:
    """(axes_dims_rope, theta) a FLUX sidecar records (absent: the family's defaults)."""
    c = info.config
    axes, theta = rope_tables.flux_setting(flux_family(info), c.axes_dims_rope, c.rope_theta,
                                           c.diffusers_config)
    return tuple(int(a) for a in axes), float(theta)


def flux_forward_kwargs(info: ModelInfo, by_role, img_shapes: Sequence[Sequence[int]]) -> dict:
    """diffusers' ``FluxTransformer2DModel`` / ``Flux2Transformer2DModel.forward`` keyword
    arguments for the graph inputs ``by_role`` (torch tensors by role, as :func:`make_inputs`
    made them): the same activations, ``pooled_projections`` and ``guidance``, and in place of
    the caches the position ids they were built from (:func:`flux_ids`), so that the stock
    model computes its RoPE from them (float64) as a pipeline's call would."""
    import torch

    txt_len = int(by_role["encoder_hidden_states"].shape[1])
    txt_ids, img_ids = (torch.from_numpy(a) for a in flux_ids(info, img_shapes, txt_len))
    kw = dict(hidden_states=by_role["hidden_states"],
              encoder_hidden_states=by_role["encoder_hidden_states"],
              timestep=by_role["timestep"], txt_ids=txt_ids, img_ids=img_ids, return_dict=False)
    for role in (model_io.POOLED_PROJECTIONS.role, model_io.GUIDANCE.role):
        if role in by_role:
            kw[role] = by_role[role]
    return kw


def make_inputs(info: ModelInfo, img_shapes: Sequence[Sequence[int]] | None = None,
                txt_len: int | None = None, batch: int | None = None,
                seed: int = 0) -> dict[str, np.ndarray]:
    """Deterministic inputs for every graph input of ``info`` (in graph order) for these sizes
    (default: the export sample): activations ~ N(0, 1) in the model dtype, a text mask with the
    last quarter of the second batch item's tokens masked (all ones for batch 1), timesteps in
    (0, 1), and the correct caches for the sidecar's family: Qwen-Image's from
    build_qwen_rope_caches; FLUX.1's / FLUX.2's from the position ids its pipelines pass
    (:func:`flux_ids`: the first image the output, the others condition / reference images) by
    build_flux_rope_caches, a FLUX ``pooled_projections`` ~ N(0, 1) and a ``guidance`` scale in
    [1, 5] where the graph has them (a FLUX graph has no mask)."""
    img_shapes = [tuple(int(v) for v in s) for s in (img_shapes or info.sample["img_shapes"])]
    txt_len = int(txt_len or info.sample["txt_len"])
    batch = int(batch or info.sample["batch"])
    img_tokens = sum(f * h * w for f, h, w in img_shapes)
    if flux_family(info):
        axes, theta = flux_rope_setting(info)
        caches = build_flux_rope_caches(*flux_ids(info, img_shapes, txt_len), axes_dims=axes,
                                        theta=theta)
    else:
        caches = build_qwen_rope_caches(img_shapes, txt_len, axes_dim=info.axes_dims_rope())
    rng = np.random.default_rng(seed)
    sizes = dict(batch=batch, img_tokens=img_tokens, txt_tokens=txt_len)
    feeds: dict[str, np.ndarray] = {}
    for t in info.inputs:
        dtype = numpy_dtype(t.dtype)
        role = info.role_of(t.name)
        if role == model_io.IMG_COS_SIN_CACHE.role:
            feeds[t.name] = caches.img.numpy().copy()
        elif role == model_io.TXT_COS_SIN_CACHE.role:
            feeds[t.name] = caches.txt.numpy().copy()
        elif role == model_io.ENCODER_HIDDEN_STATES_MASK.role:
            mask = np.ones(info.input_shape(t.name, **sizes), dtype=bool)
            if batch > 1 and txt_len > 1:
                mask[1, txt_len - max(1, txt_len // 4):] = False
            feeds[t.name] = mask.astype(dtype)
        elif role == model_io.GUIDANCE.role:  # the pipelines' guidance_scale (3.5 for dev)
            feeds[t.name] = rng.uniform(1.0, 5.0, info.input_shape(t.name, **sizes)).astype(
                np.float32).astype(dtype)
        elif role == model_io.TIMESTEP.role:
            feeds[t.name] = rng.uniform(0.05, 0.95, info.input_shape(t.name, **sizes)).astype(
                np.float32).astype(dtype)
        else:
            feeds[t.name] = rng.standard_normal(info.input_shape(t.name, **sizes)).astype(
                np.float32).astype(dtype)
    return feeds
