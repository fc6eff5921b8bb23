"""One interface over a TensorRT engine and an ONNX model: :func:`load`.

    runner = qkrope.runtime.load("attn.engine")            # or "attn.onnx" (ONNX Runtime)
    img_out, txt_out = runner(hidden_states, encoder_hidden_states,
                              image_rotary_emb=(img_cache, txt_cache))
    img_out, txt_out = runner.run_positions(hidden_states, encoder_hidden_states,
                                            img_shapes=[(1, 64, 64)])

Every call is checked **before** anything executes (:class:`qkrope.runtime.runner.Runner`: the
RoPE caches, then every input's dtype, rank, dimensions, device and contiguity); failures raise
:class:`RopeCacheError` or :class:`RunnerInputError`, whose message says what was received, what
was expected and the fix. Nothing is converted or copied silently. Outputs are per-thread
buffers reused by later calls with the same shapes (``copy_outputs=True`` to keep them); the
threads, streams and bindings of each backend are told in its runner's module.

Each backend is a loader and a runner, as in polygraphy's ``backend/<x>/{loader,runner}.py``:
:mod:`~qkrope.runtime.loader_tensorrt` deserialises the engine and
:mod:`~qkrope.runtime.runner_tensorrt` runs it; :mod:`~qkrope.runtime.loader_onnxrt` makes the
``InferenceSession`` and :mod:`~qkrope.runtime.runner_onnxrt` runs it; both runners derive from
:class:`qkrope.runtime.runner.Runner`, where the checks of a call live. :func:`load` picks the
pair from the file's suffix.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping, Sequence

from qkrope.errors import InputFileNotFoundError

from . import trt_utils as tu
from .runner import Runner, RunnerError


def load(path: str | os.PathLike, *, plugin: str | os.PathLike | None = None,
         providers: Sequence | None = None, provider_options: Sequence[Mapping] | None = None,
         sess_options=None, copy_outputs: bool = False, cuda_graph: bool = False,
         allow_host_code: bool = False) -> Runner:
    """Open a model for inference, chosen by the file suffix.

    - ``.engine`` / ``.plan``: TensorRT (needs TensorRT, a CUDA GPU and the QKNormRoPE plugin
      library the caller names: ``plugin``, else ``$QKROPE_PLUGIN_LIB``, else the library
      ``qkrope build-plugin`` built; the library ``<engine>.json`` records is never loaded
      because the file names it, only compared by sha256 with the caller's).
      A version-compatible engine carries its plugin library as host code: it is refused unless
      ``allow_host_code=True``. ``cuda_graph=True`` (off by default) replays a CUDA graph
      captured once per input shapes (see
      :class:`~qkrope.runtime.runner_tensorrt.TensorRTRunner`).
    - ``.onnx``: ONNX Runtime, passed through to ``onnxruntime.InferenceSession``:
      ``providers`` (default: CUDA if onnxruntime-gpu is installed, else CPU; names ONNX Runtime
      does not have here are refused instead of its silent fall-back to the CPU),
      ``provider_options`` (one dict per provider, e.g. ``[{"arena_extend_strategy":
      "kSameAsRequested"}]`` for the CUDA provider) and ``sess_options`` (an
      ``onnxruntime.SessionOptions``, used as given). Without ``sess_options`` the session gets
      ONNX Runtime's defaults with memory patterns off
      (:func:`~qkrope.runtime.loader_onnxrt.default_session_options`: patterns are recorded per
      set of input shapes, so with a pipeline's changing shapes resident memory grew with every
      new shape; off, it stays at the largest call's).
      Runs the model's QKNormRoPE function body; ``plugin`` and ``allow_host_code`` are
      ignored.

    The options of the other backend are refused, never ignored. Returns a :class:`Runner`;
    see the module docstring for the thread/stream/buffer model.
    """
    p = Path(path)
    if not p.exists():
        raise InputFileNotFoundError(f"{p} does not exist. Fix: pass the .onnx file `qkrope "
                                     f"export` wrote or the .engine `qkrope build` wrote")
    suffix = p.suffix.lower()
    if suffix in (".engine", ".plan", ".trt"):
        given = [n for n, v in (("providers", providers), ("provider_options", provider_options),
                                ("sess_options", sess_options)) if v is not None]
        if given:
            raise RunnerError(f"{', '.join(given)} are ONNX Runtime options; {p} is a TensorRT "
                              f"engine. Fix: drop them (or load the .onnx file)")
        try:
            tu.check_engine_file(p)  # an ONNX model or an empty file: said before TensorRT
        except tu.NotAnEngineError as exc:
            raise RunnerError(str(exc)) from None
        from .loader_tensorrt import engine_from_path
        from .runner_tensorrt import TensorRTRunner

        return TensorRTRunner(engine_from_path(p, plugin=plugin, allow_host_code=allow_host_code),
                              copy_outputs=copy_outputs, cuda_graph=cuda_graph)
    if suffix == ".onnx":
        if cuda_graph:
            raise RunnerError(
                f"cuda_graph=True replays CUDA graphs of a TensorRT engine; {p} is an ONNX model "
                f"(ONNX Runtime). Fix: build an engine with `qkrope build {p}` and load it, or "
                f"for ONNX Runtime's own CUDA graphs pass providers=['CUDAExecutionProvider'], "
                f"provider_options=[{{'enable_cuda_graph': '1'}}]")
        from .loader_onnxrt import session_from_onnx
        from .runner_onnxrt import OrtRunner

        return OrtRunner(session_from_onnx(p, providers=providers, session_options=sess_options,
                                           provider_options=provider_options),
                         copy_outputs=copy_outputs)
    raise RunnerError(f"cannot tell the backend of {p} from its suffix {suffix!r}: use .engine or "
                      f".plan for TensorRT, .onnx for ONNX Runtime")


__all__ = ["load"]
