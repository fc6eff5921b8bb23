"""Triton Python-backend model: the RoPE caches of a request, from Qwen-Image's image shapes and
text length, or from FLUX.1's / FLUX.2's position ids.

``qkrope triton-repo`` copies this file to ``REPO/<name>_rope/1/model.py`` (and
:mod:`qkrope.runtime.rope_tables` next to it as ``rope_tables.py``) for a transformer engine or
ONNX model: the ensemble ``REPO/<name>`` feeds its outputs to the main model, so clients send
only what a diffusers pipeline has. The server's Python needs numpy and nothing else (numpy < 2
for Triton servers up to 2.52, whose Python backend corrupts outputs under numpy 2).

Inputs (names from the model's ``config.pbtxt``), Qwen-Image (``positions`` "shapes"):
    ``img_shapes``  INT64 [-1, 3]: one row per image, (frames, height, width) in latent patches
    the latent (``parameters { key: "latent_tensor" }``, ``hidden_states`` [batch, tokens, C]):
        only its shape is read; the image rows must add up to its token count
    the text tensor (``parameters { key: "txt_tensor" }``, the prompt mask
        ``encoder_hidden_states_mask`` [batch, txt_tokens]): only its shape is read, axis 1
        being the text length (the padded length, as diffusers' QwenImageTransformer2DModel
        uses it)
FLUX.1 / FLUX.2 (``positions`` "ids"):
    ``txt_ids`` / ``img_ids``  FP32 [-1, len(axes_dim)]: the position ids the pipeline passes to
        the transformer (one row per token; a pipeline's [batch, tokens, axes] ids: item 0)
    the latent and the text tensor (``encoder_hidden_states`` [batch, txt_tokens, C]): only
        their shapes are read; each stream's ids have one row per token of it
Outputs: ``img_cos_sin_cache`` / ``txt_cos_sin_cache`` FP32 [rows, sum(axes_dim)], exactly
:func:`qkrope.runtime.caches.build_qwen_rope_caches` of the same shapes, or
:func:`qkrope.runtime.caches.build_flux_rope_caches` of the same ids.

Parameters: ``positions`` ("shapes", the default, or "ids"), ``axes_dim`` and ``theta``
(default: Qwen-Image's, from ``rope_tables``), ``scale_rope`` ("true"; shapes only),
``max_img_tokens`` / ``max_txt_tokens`` (what the served model accepts: its profile's largest
cache rows), ``cache_bytes`` (the most bytes of computed caches kept for reuse).

A request the model cannot serve (malformed, inconsistent or beyond the limits) is answered with
``TritonError(..., TritonError.INVALID_ARG)``: HTTP 400 / gRPC INVALID_ARGUMENT, with the reason.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
from pathlib import Path

import numpy as np

pb_utils = None  # triton_python_backend_utils, imported when Triton initialises the model

#: The tensor names used where the model config names none: the exporter's (qkrope/model_io.py).
#: Spelled here because this file runs inside a server without qkrope; a test keeps them equal.
DEFAULT_NAMES = {"txt_tensor": "encoder_hidden_states_mask",
                 "ids_txt_tensor": "encoder_hidden_states",  # FLUX: no mask; its text itself
                 "latent_tensor": "hidden_states",
                 "img_output": "img_cos_sin_cache", "txt_output": "txt_cos_sin_cache"}


def _load_tables():
    path = Path(__file__).with_name("rope_tables.py")
    spec = importlib.util.spec_from_file_location("qkrope_rope_tables", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _param(config: dict, key: str, default: str) -> str:
    value = config.get("parameters", {}).get(key)
    if isinstance(value, dict):
        value = value.get("string_value")
    return default if value in (None, "") else str(value)


def _show(rows) -> str:
    """img_shapes for a message: the first few rows (a hostile request may send thousands)."""
    rows = [list(r) for r in rows]
    return str(rows) if len(rows) <= 4 else f"{str(rows[:4])[:-1]}, ... ({len(rows)} images)]"


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int), ("device_id", ctypes.c_int)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):  # the head of DLManagedTensor (dlpack.h)
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64))]


def _dlpack_shape(capsule) -> tuple[int, ...]:
    """The shape of a DLPack capsule, read without consuming it."""
    get = ctypes.pythonapi.PyCapsule_GetPointer
    get.restype, get.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    t = _DLTensor.from_address(get(capsule, b"dltensor"))
    return tuple(int(t.shape[i]) for i in range(t.ndim))


def tensor_shape(tensor) -> tuple[int, ...]:
    """A request tensor's shape: through numpy, or for a dtype numpy lacks (BF16: the Python
    backend's ``as_numpy`` refuses it) through its DLPack capsule, without reading the data."""
    try:
        return tuple(tensor.as_numpy().shape)
    except Exception:  # noqa: BLE001 - "Tensor dtype is BF16 and cannot be converted to NumPy"
        return _dlpack_shape(tensor.to_dlpack())


class RequestError(ValueError):
    """What the client sent cannot be served (answered as INVALID_ARG)."""


class TritonPythonModel:
    def initialize(self, args):
        global pb_utils
        import triton_python_backend_utils as utils  # only inside Triton (or a test's stand-in)

        pb_utils = utils
        self.tables = _load_tables()
        config = json.loads(args["model_config"])
        default_axes = ",".join(str(v) for v in self.tables.AXES_DIM)
        self.positions = _param(config, "positions", "shapes")
        if self.positions not in ("shapes", "ids"):
            raise ValueError(f"parameter positions must be 'shapes' or 'ids'; got "
                             f"{self.positions!r}")
        self.axes_dim = tuple(int(v) for v in _param(config, "axes_dim", default_axes).split(","))
        self.theta = float(_param(config, "theta", str(self.tables.THETA)))
        self.scale_rope = _param(config, "scale_rope", "true").lower() in ("1", "true", "yes")
        self.txt_tensor = _param(config, "txt_tensor", DEFAULT_NAMES[
            "ids_txt_tensor" if self.positions == "ids" else "txt_tensor"])
        self.latent_tensor = _param(config, "latent_tensor", DEFAULT_NAMES["latent_tensor"])
        self.img_name = _param(config, "img_output", DEFAULT_NAMES["img_output"])
        self.txt_name = _param(config, "txt_output", DEFAULT_NAMES["txt_output"])
        self.max_img = int(_param(config, "max_img_tokens", "4096"))
        self.max_txt = int(_param(config, "max_txt_tokens", "512"))
        self.cache = self.tables.CacheBudget(int(_param(config, "cache_bytes", str(64 * 2**20))))
        if self.positions == "shapes":
            self.tables.axis_tables(self.theta, self.axes_dim)  # at load, not in the first request

    def _tensor(self, request, name):
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is None:
            raise RequestError(f"the request has no {name!r} input")
        return tensor

    def _input(self, request, name):
        return self._tensor(request, name).as_numpy()

    def _shapes(self, request) -> tuple:
        shapes = np.asarray(self._input(request, "img_shapes"))
        if shapes.ndim != 2 or shapes.shape[1] != 3 or shapes.shape[0] < 1:
            raise RequestError(f"img_shapes must be [images, 3] (frames, height, width in latent "
                               f"patches, e.g. [[1, 64, 64]] for a 1024x1024 image); got shape "
                               f"{list(shapes.shape)}")
        if shapes.shape[0] > self.max_img:  # every image has at least one token
            raise RequestError(f"img_shapes has {shapes.shape[0]} images, more than the "
                               f"{self.max_img} image tokens the served model accepts")
        if not np.issubdtype(shapes.dtype, np.integer) or (shapes < 1).any():
            raise RequestError(f"img_shapes entries must be positive integers; got "
                               f"{_show(shapes.tolist())}")
        rows = tuple(tuple(int(v) for v in row) for row in shapes)
        tokens = sum(f * h * w for f, h, w in rows)  # Python ints: no overflow
        if tokens > self.max_img:
            raise RequestError(
                f"img_shapes {_show(rows)} give {tokens} image tokens, more than the "
                f"{self.max_img} the served model accepts (its profile's largest image cache); "
                f"the shapes are in latent patches (a 1024x1024 image is [1, 64, 64])")
        return rows

    def _from_ids(self, request):
        """FLUX: the caches of the request's txt_ids / img_ids, each stream's rows checked
        against its tensor's tokens and the served model's limits."""
        pos = {}
        for stream, tensor, limit in (("img", self.latent_tensor, self.max_img),
                                      ("txt", self.txt_tensor, self.max_txt)):
            name = f"{stream}_ids"
            try:
                ids = self.tables.check_ids(self._input(request, name), len(self.axes_dim), name)
            except self.tables.BadPositions as exc:
                raise RequestError(str(exc)) from None
            shape = tensor_shape(self._tensor(request, tensor))  # only the shape is read
            rows = ids.shape[0]
            if len(shape) != 3 or shape[1] != rows:
                raise RequestError(f"{name} has {rows} rows (one per token) but {tensor} has "
                                   f"shape {list(shape)}: the ids must be those of its tokens "
                                   f"(axis 1)")
            if rows > limit:
                raise RequestError(f"{name} has {rows} tokens, more than the {limit} the served "
                                   f"model accepts (its profile's largest {stream} cache)")
            pos[stream] = ids
        key = (pos["txt"].shape, pos["txt"].tobytes(), pos["img"].shape, pos["img"].tobytes())
        caches = self.cache.get(key)
        if caches is None:
            caches = tuple(self.tables.flux_cache(pos[s], axes_dim=self.axes_dim, theta=self.theta)
                           for s in ("img", "txt"))
            self.cache.put(key, caches)
        return caches

    def _one(self, request):
        if self.positions == "ids":
            img, txt = self._from_ids(request)
            return pb_utils.InferenceResponse(output_tensors=[
                pb_utils.Tensor(self.img_name, img), pb_utils.Tensor(self.txt_name, txt)])
        rows = self._shapes(request)
        text = tensor_shape(self._tensor(request, self.txt_tensor))  # only the shapes are read
        latent = tensor_shape(self._tensor(request, self.latent_tensor))
        if len(text) != 2 or text[1] < 1:
            raise RequestError(f"{self.txt_tensor} must be [batch, txt_tokens] with at least one "
                               f"token; got shape {list(text)}")
        txt_len = int(text[1])
        if txt_len > self.max_txt:
            raise RequestError(f"{self.txt_tensor} has {txt_len} text tokens, more than the "
                               f"{self.max_txt} the served model accepts (its profile's "
                               f"largest text cache)")
        tokens = self.tables.image_tokens(rows)
        if len(latent) != 3 or latent[1] != tokens:
            raise RequestError(
                f"img_shapes {_show(rows)} give {tokens} image tokens but "
                f"{self.latent_tensor} has shape {list(latent)}: img_shapes are the "
                f"latent patch grids (frames, height / vae_scale / 2, width / vae_scale / 2) of "
                f"the images, and their tokens are {self.latent_tensor}'s axis 1")
        key = (rows, txt_len)
        caches = self.cache.get(key)
        if caches is None:
            try:
                caches = self.tables.qwen_caches(rows, txt_len, theta=self.theta,
                                                 axes_dim=self.axes_dim,
                                                 scale_rope=self.scale_rope)
            except self.tables.PositionOverflow as exc:
                raise RequestError(str(exc)) from None
            self.cache.put(key, caches)
        img, txt = caches
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor(self.img_name, img), pb_utils.Tensor(self.txt_name, txt)])

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                responses.append(self._one(request))
            except RequestError as exc:  # the client's mistake: 400 / INVALID_ARGUMENT
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.
                                 TritonError(str(exc), pb_utils.TritonError.INVALID_ARG)))
            except Exception as exc:  # noqa: BLE001 - ours: one request fails, not the batch
                responses.append(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.
                                 TritonError(f"{type(exc).__name__}: {exc}")))
        return responses

    def finalize(self):
        pass
