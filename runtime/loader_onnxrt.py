"""The ONNX Runtime loader of :func:`qkrope.runtime.load`: the session options, the providers,
ONNX Runtime's load errors as one line with the fix, and :func:`session_from_onnx`, which checks
the model and makes the ``InferenceSession`` that :class:`~qkrope.runtime.runner_onnxrt.OrtRunner`
runs.

By default the session has memory patterns off (:func:`default_session_options`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from qkrope import quantization
from qkrope._deps import require

from . import onnx_file
from .io_specs import onnx_model_io
from .runner import RunnerError


@dataclass
class OnnxSession:
    """What :func:`session_from_onnx` made: the session and what it was made from."""

    session: Any            # onnxruntime.InferenceSession
    path: str
    model: Any              # the onnx.ModelProto, read and checked before ONNX Runtime saw it
    providers: list
    session_options: Any    # onnxruntime.SessionOptions


def default_session_options(ort=None):
    """The ``onnxruntime.SessionOptions`` :func:`load` uses when none are given: ONNX Runtime's
    defaults except ``enable_mem_pattern = False``.

    A memory pattern is the allocation plan ONNX Runtime records for one set of input shapes and
    replays as one block from its arena; with shapes that change from call to call (a pipeline:
    two text lengths under true CFG, a new image size per request) every new set of shapes adds
    its block, so resident memory grows with the number of shapes seen (measured with
    ``scripts/memory_growth.py`` on a tiny transformer, 12 calls alternating two image sizes and
    two text lengths: peak RSS +36 % after the first four calls with patterns, +0 % without).
    The CPU arena stays on: its size is set by the largest call (flat across those 12 calls)
    and it saves an allocation per tensor."""
    ort = ort if ort is not None else require("onnxruntime", "the ONNX Runtime runner")
    so = ort.SessionOptions()
    so.enable_mem_pattern = False
    return so


def _check_providers(ort, providers, provider_options) -> None:
    """Provider names ONNX Runtime has here (it would otherwise warn and quietly run on the CPU)
    and one options dict per provider."""
    names = [p if isinstance(p, str) else (p[0] if isinstance(p, (tuple, list)) and p else p)
             for p in providers]
    available = ort.get_available_providers()
    unknown = [n for n in names if not isinstance(n, str) or n not in available]
    if unknown:
        raise RunnerError(
            f"providers {unknown} are not available in this onnxruntime ({ort.__version__}); "
            f"it has {available}. Fix: pick from those (onnxruntime-gpu for "
            f"CUDAExecutionProvider: pip install 'qkrope[cuda]')")
    if provider_options is not None:
        if not isinstance(provider_options, (list, tuple)) or len(provider_options) != len(
                names) or not all(isinstance(o, Mapping) for o in provider_options):
            raise RunnerError(
                f"provider_options must be a list of one dict per provider ({len(names)}: "
                f"{names}); got {provider_options!r}. Fix: e.g. providers=['CUDAExecutionProvider'"
                f"], provider_options=[{{'arena_extend_strategy': 'kSameAsRequested'}}]")


def ort_load_error(path: str, providers, exc: Exception, *,
                   action: str = "could not load") -> RunnerError:
    """ONNX Runtime's failure (to create a session, by default) as one line with the fix."""
    text = " ".join(str(exc).split())
    for prefix in ("[ONNXRuntimeError] :",):
        if text.startswith(prefix):
            text = text[len(prefix):].lstrip(" 0123456789:").strip()
    text = text[:400]
    if "NOT_IMPLEMENTED" in str(exc) or "Could not find an implementation" in str(exc):
        return RunnerError(
            f"ONNX Runtime ({', '.join(map(str, providers))}) has no kernel for an "
            f"op of {path} in its dtype: {text}. ONNX Runtime's CPU provider has no "
            f"bfloat16 MatMul/Gemm. Fix: use onnxruntime-gpu with "
            f"providers=['CUDAExecutionProvider'], export with --dtype fp32 for CPU use, "
            f"or build a TensorRT engine")
    if "xternal data" in text:
        fix = ("keep the model's external-data files next to it, under the names the model "
               "records (relative, inside its folder), or re-export it with `qkrope export`")
    else:
        fix = f"re-export it with `qkrope export --out {path}`"
    return RunnerError(f"ONNX Runtime {action} {path} ({type(exc).__name__}: {text}). "
                       f"Fix: {fix}")


def default_providers() -> list[str]:
    import onnxruntime as ort

    avail = ort.get_available_providers()
    return (["CUDAExecutionProvider", "CPUExecutionProvider"]
            if "CUDAExecutionProvider" in avail else ["CPUExecutionProvider"])



def session_from_onnx(path: str | os.PathLike, *, providers: Sequence | None = None,
                      session_options=None,
                      provider_options: Sequence[Mapping] | None = None) -> OnnxSession:
    """The ``InferenceSession`` of an exported model, after qkrope's checks: a readable model
    whose QKNormRoPE nodes keep the node contract (the plugin creator would refuse what ONNX
    Runtime's function body would silently run) and a sidecar in its schema, before ONNX Runtime
    sees the file; provider names ONNX Runtime has here, one options dict per provider, and a
    real ``SessionOptions``. ONNX Runtime's own failure is one line (:func:`ort_load_error`)."""
    ort = require("onnxruntime", "the ONNX Runtime runner")
    path = str(path)
    model = onnx_file.checked_onnx_model(path)
    onnx_model_io(path, model=model)
    if isinstance(providers, str):
        providers = [providers]
    providers = list(providers) if providers else default_providers()
    _check_providers(ort, providers, provider_options)
    if session_options is not None and not isinstance(session_options, ort.SessionOptions):
        raise RunnerError(f"sess_options must be an onnxruntime.SessionOptions; got "
                          f"{type(session_options).__name__}. Fix: so = "
                          f"onnxruntime.SessionOptions(); so.enable_mem_pattern = False; "
                          f"load(..., sess_options=so)")
    session_options = (session_options if session_options is not None
                       else default_session_options(ort))
    # an FP8 (Q/DQ) export runs only with ONNX Runtime's Q/DQ fusions off
    session_options = quantization.ort_session_options(model, session_options)
    try:
        session = ort.InferenceSession(
            path, sess_options=session_options, providers=providers,
            provider_options=None if provider_options is None else [
                dict(o) for o in provider_options])
    except Exception as exc:  # noqa: BLE001 - ONNX Runtime's Fail/InvalidGraph/... classes
        raise ort_load_error(path, providers, exc) from exc
    return OnnxSession(session, path, model, providers, session_options)


__all__ = ["OnnxSession", "default_providers", "default_session_options", "ort_load_error",
           "session_from_onnx"]
