"""Triton Python-backend model: the RoPE caches of a request, from what a diffusers pipeline
passes its transformer, through the model's position scheme (parameter ``scheme``).

``qkrope triton-repo`` copies this file to ``REPO/<name>_rope/1/model.py`` and the position
schemes (:mod:`qkrope.runtime.schemes`, numpy only) next to it as the package ``schemes/``, for a
transformer engine or ONNX model: the ensemble ``REPO/<name>`` feeds its outputs to the main
model, so clients send only what a pipeline has. The server's Python needs numpy and nothing
else (numpy < 2 for Triton servers up to 2.52, whose Python backend corrupts outputs under
numpy 2). Nothing here names a model family: the scheme and its numbers are parameters.

Inputs (names from the model's ``config.pbtxt``): the scheme's own (its ``triton_inputs``:
"grid" / "patch-grid" ``img_shapes`` INT64 [-1, 3]; "ids" ``txt_ids`` / ``img_ids`` FP32
[-1, axes]; "table" the same in INT64; "scaled_grid" ``grid`` INT64 [3] and ``fps`` FP32 [1]),
the latent (``parameters { key: "latent_tensor" }``: ``hidden_states`` [batch, tokens, C], or a
video model's 5-D ``latent``) and the text (``parameters { key: "txt_tensor" }``: the prompt mask
where the model has one, else ``encoder_hidden_states``; a comma list where the model joins
other inputs to its text, whose axis-1 lengths add up), of which only the shapes are read (the
tokens of each stream). Outputs: ``img_cos_sin_cache`` / ``txt_cos_sin_cache`` FP32
[rows, sum(axes_dim)], those the model takes, exactly
:func:`qkrope.runtime.caches.build_rope_caches` of the same request.

Parameters: ``scheme`` (a name of ``schemes.SCHEMES``; repositories written before schemes had
names say ``positions`` "shapes" / "ids"), the RoPE setting (``axes_dim``, ``theta``,
``max_positions``, ``scale_rope``, ``rotated``: the streams rotated, default "img,txt";
``precision``; ``axis_thetas``, ``base_fps`` and ``table_lengths`` where the scheme needs
them), ``latent_patch``
(a 5-D latent's patch size "t,h,w": its tokens are the patches), ``outputs`` (the streams whose
caches the model takes, default "img,txt"), ``max_img_tokens`` / ``max_txt_tokens`` (what the
served model accepts: its profile's largest cache rows), ``cache_bytes`` (the most bytes of
computed caches kept for reuse).

The ranks and batch of the latent, the text and the mask, and the positions a table holds, are
checked by the same functions the local drop-in runs (``schemes.check_token_shapes``, the
scheme's own checks): one check, one home, the same line on both paths.

A request the model cannot serve (malformed, inconsistent or beyond the limits) is answered with
``TritonError(..., TritonError.INVALID_ARG)``: HTTP 400 / gRPC INVALID_ARGUMENT, with the reason.
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import sys
from pathlib import Path

import numpy as np

pb_utils = None  # triton_python_backend_utils, imported when Triton initialises the model

#: The tensor names used where the model config names none: the exporter's (qkrope/model_io.py).
#: Spelled here because this file runs inside a server without qkrope; a test keeps them equal.
DEFAULT_NAMES = {"txt_tensor": "encoder_hidden_states_mask",
                 "ids_txt_tensor": "encoder_hidden_states",  # no mask: the text itself
                 "latent_tensor": "hidden_states",
                 "img_output": "img_cos_sin_cache", "txt_output": "txt_cos_sin_cache"}
#: Repositories written before the schemes had names: their ``positions`` parameter.
_OLD_POSITIONS = {"shapes": "grid", "ids": "ids"}


def _load_schemes():
    """The ``schemes`` package beside this file, imported by path under a private name (its
    modules import each other relatively)."""
    name = f"qkrope_rope_schemes_{abs(hash(str(Path(__file__).parent)))}"
    if name in sys.modules:
        return sys.modules[name]
    folder = Path(__file__).with_name("schemes")
    spec = importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                  submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def _param(config: dict, key: str, default: str) -> str:
    value = config.get("parameters", {}).get(key)
    if isinstance(value, dict):
        value = value.get("string_value")
    return default if value in (None, "") else str(value)


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
        self.schemes = _load_schemes()
        config = json.loads(args["model_config"])
        name = _param(config, "scheme", "")
        if not name:
            old = _param(config, "positions", "shapes")
            name = _OLD_POSITIONS.get(old, old)
        if name not in self.schemes.SCHEMES:
            raise ValueError(f"parameter scheme must be one of {sorted(self.schemes.SCHEMES)}; "
                             f"got {name!r}")
        self.scheme = self.schemes.scheme(name)
        max_positions = _param(config, "max_positions", "")
        axis_thetas = _param(config, "axis_thetas", "")
        base_fps = _param(config, "base_fps", "")
        lengths = _param(config, "table_lengths", "")
        self.setting = self.schemes.Setting(
            tuple(int(v) for v in _param(config, "axes_dim", "").split(",")),
            float(_param(config, "theta", "")),
            int(max_positions) if max_positions else None,
            _param(config, "scale_rope", "true").lower() in ("1", "true", "yes"),
            tuple(s for s in _param(config, "rotated", "img,txt").split(",") if s),
            _param(config, "precision", "float32"),
            tuple(float(v) for v in axis_thetas.split(",")) if axis_thetas else None,
            float(base_fps) if base_fps else None,
            table_lengths=tuple(int(v) for v in lengths.split(",")) if lengths else None)
        missing = [n for n in self.scheme.NEEDS if getattr(self.setting, n) is None]
        if missing:  # a config written for another model.py (the numbers were constants there)
            raise ValueError(f"the rope model's config.pbtxt has no {', '.join(missing)} "
                             f"parameter, which the {name!r} scheme needs (the repository was "
                             f"written by an older qkrope). Fix: write the repository again "
                             f"with this qkrope: qkrope triton-repo ... --force")
        # the text length: the sum of these inputs' axis 1 (the prompt mask or the text, then
        # what the model joins to its text); the image tokens: the latent's axis 1, or for a
        # 5-D latent ("latent_patch": the model's patch size) its token grid's product
        self.txt_tensors = tuple(_param(config, "txt_tensor", DEFAULT_NAMES[
            "ids_txt_tensor" if name == "ids" else "txt_tensor"]).split(","))
        self.txt_tensor = self.txt_tensors[0]
        self.latent_tensor = _param(config, "latent_tensor", DEFAULT_NAMES["latent_tensor"])
        # the mask's declared type (the main model's): its dtype is checked as locally
        self.mask_dtype = {i.get("name"): self.schemes._common.TRITON_MASK_DTYPES.get(
            str(i.get("data_type", ""))) for i in config.get("input", [])
            if isinstance(i, dict)}.get(DEFAULT_NAMES["txt_tensor"])
        patch = _param(config, "latent_patch", "")
        self.latent_patch = tuple(int(v) for v in patch.split(",")) if patch else None
        self.img_name = _param(config, "img_output", DEFAULT_NAMES["img_output"])
        self.txt_name = _param(config, "txt_output", DEFAULT_NAMES["txt_output"])
        # the caches the main model takes (a model whose text is not rotated may take no text
        # cache)
        self.outputs = tuple(_param(config, "outputs", "img,txt").split(","))
        self.max_img = int(_param(config, "max_img_tokens", "4096"))
        self.max_txt = int(_param(config, "max_txt_tokens", "512"))
        self.cache = self.schemes.CacheBudget(int(_param(config, "cache_bytes", str(64 * 2**20))))
        self.inputs = [n for n, _, _ in self.scheme.triton_inputs(self.setting)]
        if name == "grid":  # the position tables at load, not in the first request
            self.scheme.axis_tables(self.setting.theta, self.setting.axes_dim,
                                    self.setting.max_positions, self.setting.precision)

    def _tensor(self, request, name):
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is None:
            raise RequestError(f"the request has no {name!r} input")
        return tensor

    def _text_shape(self, request) -> tuple:
        """``[batch, text tokens]``: the first text input's, its length the sum over all."""
        shapes = [tensor_shape(self._tensor(request, n)) for n in self.txt_tensors]
        for name, shape in zip(self.txt_tensors, shapes):
            if len(shape) < 2:
                raise RequestError(f"{name} must be [batch, tokens, ...]; got shape "
                                   f"{list(shape)}")
        return tuple(shapes[0][:1]) + (sum(int(s[1]) for s in shapes),)

    def _latent_shape(self, request) -> tuple:
        """The latent's shape as tokens, ``[batch, tokens, ...]``: a 5-D latent
        ``[batch, channels, frames, height, width]`` counts its patches."""
        shape = tensor_shape(self._tensor(request, self.latent_tensor))
        if self.latent_patch is None:
            return shape
        if len(shape) != 5 or any(a < 1 or a % p for a, p in zip(shape[2:], self.latent_patch)):
            raise RequestError(
                f"{self.latent_tensor} must be [batch, channels, frames, height, width] with "
                f"each of the last three a whole number of the model's "
                f"{list(self.latent_patch)} patches; got shape {list(shape)}")
        tokens = 1
        for a, p in zip(shape[2:], self.latent_patch):
            tokens *= a // p
        return (shape[0], tokens, shape[1])

    def _check_shapes(self, request) -> None:
        """The ranks and batch of the latent, the text and the mask: the local runner's own
        check (``schemes.check_token_shapes``), so a request is refused here as a local call
        with the same tensors is there, with the same line."""
        latent = tensor_shape(self._tensor(request, self.latent_tensor))
        shapes = {n: tensor_shape(self._tensor(request, n)) for n in self.txt_tensors}
        self.schemes.check_token_shapes(latent, shapes.get(DEFAULT_NAMES["ids_txt_tensor"]),
                                        shapes.get(DEFAULT_NAMES["txt_tensor"]),
                                        latent_5d=self.latent_patch is not None)
        mask = DEFAULT_NAMES["txt_tensor"]
        if mask in self.txt_tensors:
            self.schemes.check_mask_dtype(
                str(self._tensor(request, mask).as_numpy().dtype), self.mask_dtype, mask)

    def _one(self, request):
        names = {"txt": " + ".join(self.txt_tensors), "latent": self.latent_tensor}
        try:
            self._check_shapes(request)
            inputs = {n: self._tensor(request, n).as_numpy() for n in self.inputs}
            shapes = {"txt": self._text_shape(request),  # shapes only
                      "latent": self._latent_shape(request)}
            pos = self.scheme.triton_positions(inputs, shapes, names, self.setting,
                                               max_img=self.max_img, max_txt=self.max_txt)
            key = self.scheme.key(pos)
            caches = self.cache.get(key)
            if caches is None:
                caches = self.scheme.build(pos, self.setting)
                self.cache.put(key, caches)
        except self.schemes.BadRequest as exc:  # PositionOverflow and BadPositions included
            raise RequestError(str(exc)) from None
        out = {"img": (self.img_name, caches[0]), "txt": (self.txt_name, caches[1])}
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor(*out[s]) for s in self.outputs])

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
