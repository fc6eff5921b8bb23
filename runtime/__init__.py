"""Host side at inference: RoPE caches (build, convert, validate), engines and runners.

``import qkrope.runtime`` imports nothing heavy: each public name below is imported from its
module on first use (``from qkrope.runtime import load`` imports the runner, hence torch), and
TensorRT and ONNX Runtime only when a backend is used. So a command can import the light
modules it checks its arguments with (``qkrope.runtime.profiles``, ``.engine``) before torch.
"""

from __future__ import annotations

import importlib

# public name -> the module that defines it
_PUBLIC = {
    # RoPE caches
    "RopeCacheError": "caches", "RopeCacheOverflowError": "caches", "RopeCaches": "caches",
    "build_qwen_rope_caches": "caches", "caches_for": "caches",
    "to_cos_sin_caches": "caches", "validate_cos_sin_caches": "caches",
    # runtime wrapper (TensorRT engine or ONNX model behind one interface)
    "load": "backends", "Runner": "runner", "RunnerError": "runner",
    "RunnerInputError": "runner",
    # drop-in for diffusers' QwenImageTransformer2DModel in pipelines
    "QwenImageTransformer": "transformer", "load_transformer": "transformer",
}

__all__ = list(_PUBLIC)


def __getattr__(name: str):
    module = _PUBLIC.get(name)
    if module is None:
        try:  # a submodule accessed as an attribute (qkrope.runtime.caches)
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise  # the submodule exists; something it imports does not
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_PUBLIC))
