"""Triton Python-backend model: Qwen-Image RoPE caches from the image shapes and text length.

``qkrope triton-repo`` copies this file to ``REPO/<name>_rope/1/model.py`` for a transformer
engine or ONNX model: the ensemble ``REPO/<name>`` feeds its outputs to the main model, so
clients send only what a diffusers pipeline has.

Inputs (names from the model's ``config.pbtxt``):
    ``img_shapes``  INT64 [-1, 3]: one row per image, (frames, height, width) in latent patches
    the text tensor (``parameters { key: "txt_tensor" }``, the prompt mask
    ``encoder_hidden_states_mask`` [batch, txt_tokens]): only its shape is read, axis 1 being
    the text length (the padded length, as diffusers' QwenImageTransformer2DModel uses it)
Outputs: ``img_cos_sin_cache`` / ``txt_cos_sin_cache`` FP32 [rows, sum(axes_dim)], exactly
:func:`qkrope.runtime.caches.build_qwen_rope_caches` of the same shapes.

Parameters: ``axes_dim`` ("16,56,56"), ``theta`` ("10000"), ``scale_rope`` ("true").

The server's Python environment needs qkrope (and torch) installed: ``pip install qkrope``
in the Python backend's environment (or an ``EXECUTION_ENV_PATH`` archive holding it).
"""

from __future__ import annotations

import json

import numpy as np

pb_utils = None  # triton_python_backend_utils, imported when Triton initialises the model


def _param(config: dict, key: str, default: str) -> str:
    value = config.get("parameters", {}).get(key)
    if isinstance(value, dict):
        value = value.get("string_value")
    return default if value in (None, "") else str(value)


class TritonPythonModel:
    def initialize(self, args):
        global pb_utils
        import triton_python_backend_utils as utils  # only inside Triton (or a test's stand-in)

        pb_utils = utils
        from qkrope.runtime.caches import build_qwen_rope_caches

        self._build = build_qwen_rope_caches
        config = json.loads(args["model_config"])
        self.axes_dim = tuple(int(v) for v in _param(config, "axes_dim", "16,56,56").split(","))
        self.theta = float(_param(config, "theta", "10000"))
        self.scale_rope = _param(config, "scale_rope", "true").lower() in ("1", "true", "yes")
        self.txt_tensor = _param(config, "txt_tensor", "encoder_hidden_states_mask")
        self.img_name = _param(config, "img_output", "img_cos_sin_cache")
        self.txt_name = _param(config, "txt_output", "txt_cos_sin_cache")

    def _one(self, request):
        shapes = pb_utils.get_input_tensor_by_name(request, "img_shapes").as_numpy()
        text = pb_utils.get_input_tensor_by_name(request, self.txt_tensor).as_numpy()
        shapes = np.asarray(shapes)
        if shapes.ndim != 2 or shapes.shape[1] != 3:
            raise ValueError(f"img_shapes must be [images, 3] (frames, height, width in latent "
                             f"patches); got shape {list(shapes.shape)}")
        if text.ndim < 2:
            raise ValueError(f"{self.txt_tensor} must be [batch, txt_tokens]; got shape "
                             f"{list(text.shape)}")
        caches = self._build([tuple(int(v) for v in row) for row in shapes], int(text.shape[1]),
                             theta=self.theta, axes_dim=self.axes_dim, scale_rope=self.scale_rope)
        img = caches.img.detach().cpu().numpy().astype(np.float32, copy=True)
        txt = caches.txt.detach().cpu().numpy().astype(np.float32, copy=True)
        return pb_utils.InferenceResponse(output_tensors=[
            pb_utils.Tensor(self.img_name, img), pb_utils.Tensor(self.txt_name, txt)])

    def execute(self, requests):
        responses = []
        for request in requests:
            try:
                responses.append(self._one(request))
            except Exception as exc:  # one bad request answers with its error, not the batch
                responses.append(pb_utils.InferenceResponse(
                    output_tensors=[], error=pb_utils.TritonError(f"{type(exc).__name__}: {exc}")))
        return responses

    def finalize(self):
        pass
