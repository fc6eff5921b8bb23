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
    "build_rope_caches": "caches", "caches_for": "caches",
    "to_cos_sin_caches": "caches", "validate_cos_sin_caches": "caches",
    # runtime wrapper (TensorRT engine or ONNX model behind one interface)
    "load": "backends", "Runner": "runner", "RunnerError": "runner",
    "RunnerInputError": "runner",
    # the pipeline drop-in of every family (the family's part: qkrope/families/<f>/dropin.py)
    "Transformer": "transformer", "load_transformer": "transformer",
    # ... whose model runs on a Triton Inference Server
    "TritonRunner": "runner_triton", "triton_transformer": "runner_triton",
    # the pipeline's other stages on their exports (qkrope export --model pipeline)
    "TextEncoderExport": "stages", "ImageEncoderExport": "stages", "VaeExport": "stages",
    "load_stage": "stages",
}

__all__ = list(_PUBLIC)
# diffusers' pipeline loader resolves a saved drop-in from model_index.json's ["qkrope.runtime",
# <class>] and looks its base class up here by diffusers' name (runtime/component.py): offered,
# not in __all__
_PUBLIC.update({"ModelMixin": "component", "DropinComponent": "component"})


_lazy_getattr, __dir__ = lazy_names(__name__, {n: f".{m}" for n, m in _PUBLIC.items()},
                                    globals(), submodules=True)


def __getattr__(name: str):
    """A public name of this package, else a family's, found through the family registry:
    every family's drop-in class (``FluxTransformer``, ``WanTransformer``, ...) and what its
    dropin module's ``PUBLIC`` offers (``build_qwen_rope_caches``, ...)."""
    try:
        return _lazy_getattr(name)
    except AttributeError:
        if name.startswith("_") or not name.isidentifier():
            raise
        from . import caches

        value = getattr(caches, name)  # caches.__getattr__ asks the families
        globals()[name] = value
        return value
