"""Host side at inference: RoPE caches (build, convert, validate), engines and runners.

``import qkrope.runtime`` imports nothing heavy: each public name below is imported from its
module on first use (``from qkrope.runtime import load`` imports the runner, hence torch), and
TensorRT and ONNX Runtime only when a backend is used. So a command can import the light
modules it checks its arguments with (``qkrope.runtime.profiles``, ``.engine``) before torch.
"""

from __future__ import annotations

from qkrope._lazy import lazy_names

# public name -> the module that defines it
_PUBLIC = {
    # RoPE caches
    "RopeCacheError": "caches", "RopeCacheOverflowError": "caches", "RopeCaches": "caches",
    "build_qwen_rope_caches": "caches", "build_flux_rope_caches": "caches",
    "caches_for": "caches",
    "to_cos_sin_caches": "caches", "validate_cos_sin_caches": "caches",
    # runtime wrapper (TensorRT engine or ONNX model behind one interface)
    "load": "backends", "Runner": "runner", "RunnerError": "runner",
    "RunnerInputError": "runner",
    # drop-in for diffusers' QwenImageTransformer2DModel in pipelines
    "QwenImageTransformer": "transformer", "load_transformer": "transformer",
    # ... and for diffusers' FluxTransformer2DModel / Flux2Transformer2DModel
    "FluxTransformer": "flux_transformer",
    # ... whose model runs on a Triton Inference Server
    "TritonRunner": "runner_triton", "triton_transformer": "runner_triton",
}

__all__ = list(_PUBLIC)


__getattr__, __dir__ = lazy_names(__name__, {n: f".{m}" for n, m in _PUBLIC.items()}, globals(),
                                  submodules=True)
