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

from typing import Any, Sequence

import numpy as np

from qkrope import dtypes, model_io
from qkrope.errors import InputError
from qkrope.sidecars import ModelInfo

from . import latents
from .caches import _check_cache_widths, build_rope_caches, model_setting


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


def sample_request(info: ModelInfo, img_shapes: Sequence[Sequence[int]],
                   txt_len: int) -> tuple[Any, dict]:
    """(the family record, the position request) of a sample of these sizes for the model
    ``info`` describes: the request its family's pipelines would pass (the family's drop-in
    ``sample_request``: grids and a text length, or the ids laid out as the pipelines lay them
    out, the first image the output and the others condition / reference images)."""
    from qkrope import families

    record = families.by_name(info.config.family, source=info.source or "the sidecar")
    hooks = families.hooks(record, "dropin")
    model_request = getattr(hooks, "model_request", None)
    if model_request is not None:  # a request that depends on the model's config
        cfg = info.config.diffusers_config if info.config is not None else None
        return record, model_request(record, dict(cfg or {}), img_shapes, txt_len)
    return record, hooks.sample_request(record, img_shapes, txt_len)


def sample_caches(info: ModelInfo, img_shapes: Sequence[Sequence[int]], txt_len: int):
    """The RoPE caches of a sample of these sizes for ``info``'s model (its family's scheme
    and the RoPE setting its sidecar records)."""
    record, request = sample_request(info, img_shapes, txt_len)
    return build_rope_caches(record.scheme, request,
                             model_setting(info.config, record, info.source or "the sidecar"))


def joined_text_sizes(info: ModelInfo) -> dict[str, int]:
    """The export sample's length of each condition axis the model joins to its text
    (:data:`qkrope.model_io.JOINED_TEXT_AXES`): a sample keeps them, and its text stream's
    positions cover the text tokens plus these."""
    named = {d for t in info.inputs for d in t.shape if isinstance(d, str)}
    exported = info.export_values()
    return {a: int(exported[a]) for a in model_io.JOINED_TEXT_AXES
            if a in named and a in exported}


def make_inputs(info: ModelInfo, img_shapes: Sequence[Sequence[int]] | None = None,
                txt_len: int | None = None, batch: int | None = None,
                seed: int = 0, txt_lens: Sequence[int] | None = None) -> dict[str, np.ndarray]:
    """Deterministic inputs for every graph input of ``info`` (in graph order) for these sizes
    (default: the export sample): activations ~ N(0, 1) in the model dtype, a text mask with the
    last quarter of the second batch item's tokens masked (all ones for batch 1), timesteps in
    (0, 1), a ``guidance`` scale in [1, 5], other conditioning (a pooled projection) ~ N(0, 1),
    and the correct caches of the sidecar's family, from the request its pipelines would pass
    for these sizes (:func:`sample_request`). A latent whose axes are a latent grid (a video
    latent ``[batch, channels, frames, height, width]``, :mod:`qkrope.runtime.latents`) gets
    the grid of the first image. ``txt_lens`` (one per batch item, each <= ``txt_len``) gives
    per-sample text lengths: the mask marks each item's real tokens (:class:`TextLengths`).
    The condition inputs a model joins to its text (:data:`qkrope.model_io.JOINED_TEXT_AXES`:
    HunyuanVideo-1.5's ByT5 tokens and image embeddings) keep the export sample's lengths, their
    masks padded as the text's, and the text cache covers the joined stream."""
    img_shapes = [tuple(int(v) for v in s) for s in (img_shapes or info.sample["img_shapes"])]
    txt_len = int(txt_len or info.sample["txt_len"])
    batch = int(batch or info.sample["batch"])
    img_tokens = sum(f * h * w for f, h, w in img_shapes)
    named = {d for t in info.inputs for d in t.shape if isinstance(d, str)}
    exported = info.export_values()
    joined = joined_text_sizes(info)
    record, request = sample_request(info, img_shapes, txt_len + sum(joined.values()))
    source = info.source or "the sidecar"
    setting = model_setting(info.config, record, source)
    # a sidecar without axes gets the family's: they must be as wide as the model's caches
    _check_cache_widths(source, [(t.name, t.shape) for t in info.inputs], setting.axes_dim)
    caches = build_rope_caches(record.scheme, request, setting)
    latent = latents.latent_of(record, info.config.diffusers_config)
    lengths = None
    if txt_lens is not None:
        lengths = latents.TextLengths.checked(txt_lens, batch, txt_len)
    rng = np.random.default_rng(seed)
    sizes = dict(batch=batch, img_tokens=img_tokens, txt_tokens=txt_len, **joined)
    sizes.update(latent.grid_axes(img_shapes[0]))
    # the frame axes of latents joined before the latent (history) take the traced sizes
    sizes.update({a: int(exported[a]) for a in model_io.HISTORY_AXES
                  if a in named and a in exported})
    feeds: dict[str, np.ndarray] = {}
    # inputs the family lays out itself (a packed sequence's indices), not drawn at random
    from qkrope import families

    own = getattr(families.hooks(record, "reference"), "sample_inputs", None)
    given = dict(own(info, dict(sizes))) if own is not None else {}
    for t in info.inputs:
        dtype = numpy_dtype(t.dtype)
        role = info.role_of(t.name)
        if t.name in given:
            feeds[t.name] = np.asarray(given[t.name]).astype(dtype)
            continue
        shape = latents.concrete_shape(t.name, info.tensor(t.name).shape, sizes)
        if role == model_io.IMG_COS_SIN_CACHE.role:
            feeds[t.name] = caches.img.numpy().copy()
        elif role == model_io.TXT_COS_SIN_CACHE.role:
            feeds[t.name] = caches.txt.numpy().copy()
        elif role == model_io.ENCODER_HIDDEN_STATES_MASK.role:
            mask = np.ones(shape, dtype=bool)
            if lengths is not None:  # per-sample sequences: each item's real tokens
                mask = lengths.mask(txt_len)
            elif batch > 1 and txt_len > 1:
                mask[1, txt_len - max(1, txt_len // 4):] = False
            feeds[t.name] = mask.astype(dtype)
        elif role == model_io.ENCODER_ATTENTION_MASK_2.role:  # padded as the text mask is
            mask = np.ones(shape, dtype=bool)
            if batch > 1 and shape[1] > 1:
                mask[1, shape[1] - max(1, shape[1] // 4):] = False
            feeds[t.name] = mask.astype(dtype)
        elif role == model_io.GUIDANCE.role:  # the pipelines' guidance_scale (3.5 for dev)
            feeds[t.name] = rng.uniform(1.0, 5.0, shape).astype(np.float32).astype(dtype)
        elif role in (model_io.TIMESTEP.role, model_io.TARGET_TIMESTEP.role):
            feeds[t.name] = rng.uniform(0.05, 0.95, shape).astype(np.float32).astype(dtype)
        else:
            feeds[t.name] = rng.standard_normal(shape).astype(np.float32).astype(dtype)
    return feeds
