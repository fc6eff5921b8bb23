"""The ONNX Runtime backend of :func:`qkrope.runtime.load`: :class:`OrtRunner` over an
``InferenceSession`` that :func:`~qkrope.runtime.loader_onnxrt.session_from_onnx` made.

One ``InferenceSession`` (thread-safe ``run``); inputs and outputs are bound zero-copy with
``IOBinding`` from torch tensors by pointer and ONNX element type. That is how bfloat16 works
(numpy has no bfloat16): no conversion happens anywhere. ONNX Runtime's CPU execution provider
has no bfloat16 kernels for most ops, so bf16 models need the CUDA provider (or export in
float32 for CPU use).
"""

from __future__ import annotations

from typing import Mapping

import torch

from qkrope import dtypes
from qkrope.model_io import TensorSpec

from .io_specs import onnx_model_io
from .loader_onnxrt import OnnxSession
from .runner import Runner, RunnerError, RunnerInputError, _torch_dtype_name


class OrtRunner(Runner):
    """ONNX Runtime backend (CPU or CUDA execution provider); zero-copy IOBinding. Takes the
    session :func:`~qkrope.runtime.loader_onnxrt.session_from_onnx` made (the model already
    checked, the providers and options already settled)."""

    backend = "onnxruntime"

    def __init__(self, loaded: OnnxSession, *, copy_outputs: bool = False):
        self.path = loaded.path
        self.providers = loaded.providers
        self.session_options = loaded.session_options
        self.session = loaded.session
        self.onnx_codes = dtypes.ONNX_BY_NAME
        super().__init__(onnx_model_io(self.path, self.session, model=loaded.model),
                         copy_outputs=copy_outputs)
        self._cuda_ok = "CUDAExecutionProvider" in self.session.get_providers()
        names = [p if isinstance(p, str) else p[0] for p in self.providers]
        self.device = torch.device("cuda" if names and names[0] == "CUDAExecutionProvider"
                                   else "cpu")

    def _check_device(self, device: torch.device) -> None:
        if device.type == "cuda" and not self._cuda_ok:
            raise RunnerInputError(
                f"the inputs are on {device} but this ONNX Runtime session runs on "
                f"{self.session.get_providers()}. Fix: pass CPU tensors, or install "
                f"onnxruntime-gpu and load with providers=['CUDAExecutionProvider']")
        if device.type not in ("cpu", "cuda"):
            raise RunnerInputError(f"the inputs are on {device}; this runner takes cpu or cuda "
                                   f"tensors. Fix: move them with .to('cpu') or .to('cuda')")

    def _resolve(self, spec: TensorSpec, axes: Mapping[str, int]) -> tuple[int, ...] | None:
        shape = []
        for (lo, hi), ax in zip(spec.dims, spec.axes):
            if lo == hi:
                shape.append(lo)
            elif ax is not None and ax in axes:
                shape.append(axes[ax])
            else:
                return None
        return tuple(shape)

    def _execute(self, feeds, axes, device):
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # ORT runs on its own stream
        shapes = [self._resolve(spec, axes) for spec in self.io.outputs]
        for spec, shape in zip(self.io.outputs, shapes):
            if shape is None and spec.dtype == "bfloat16":
                # Known before anything runs: ORT would allocate the output itself, and a
                # bfloat16 OrtValue cannot be read back through numpy.
                raise RunnerError(
                    f"cannot bind the bfloat16 output {spec.name} ({spec.describe()}): its shape "
                    f"does not follow from the inputs' named axes, and ONNX Runtime's own "
                    f"bfloat16 output cannot be read back. Fix: keep the sidecar JSON (axis "
                    f"names) next to the model, or re-export it with `qkrope export`")
        binding = self.session.io_binding()
        dev_id = (device.index or 0) if device.type == "cuda" else 0
        for name, t in feeds.items():
            binding.bind_input(name, device.type, dev_id, self.onnx_codes[_torch_dtype_name(t)],
                               list(t.shape), t.data_ptr())
        outs: list[torch.Tensor | None] = []
        for spec, shape in zip(self.io.outputs, shapes):
            if shape is None:
                binding.bind_output(spec.name, device.type, dev_id)
                outs.append(None)
            else:
                buf = self._output_buffer(spec.name, shape, dtypes.torch_dtype(spec.dtype), device)
                binding.bind_output(spec.name, device.type, dev_id,
                                    self.onnx_codes[spec.dtype], list(shape), buf.data_ptr())
                outs.append(buf)
        try:
            self.session.run_with_iobinding(binding)
        except Exception as exc:  # ORT's own exception types: one line for running out of memory
            text = str(exc)
            if "Failed to allocate memory" not in text and "BFCArena" not in text:
                raise
            given = ", ".join(f"{name} {list(t.shape)}" for name, t in feeds.items())
            raise RunnerError(
                f"ONNX Runtime ran out of {device.type} memory running the model on the shapes "
                f"{given} (Failed to allocate memory). Fix: smaller sizes (--height/--width), "
                f"fewer frames (--num-frames) or a smaller batch") from None
        if any(o is None for o in outs):
            ort_values = binding.get_outputs()
            for i, o in enumerate(outs):
                if o is None:
                    outs[i] = torch.from_numpy(ort_values[i].numpy()).to(device)
        return outs



__all__ = ["OrtRunner"]
