"""``qkrope build`` of an FP8 export (``qkrope export --quant fp8``): what differs from a float
build, kept apart from :mod:`qkrope.runtime.engine`, which calls it.

- The network is strongly typed like every qkrope build, and no precision flag is set
  (``BuilderFlag.FP8``/``FP16``/``BF16`` are for weakly typed networks): the precision of every
  tensor is the model's own, FP8 exactly where the ONNX file's QuantizeLinear/DequantizeLinear
  put it, the QKNormRoPE plugin in the model's float type between them.
- FP8 GEMMs need compute capability 8.9 (Ada) or later (Hopper 9.0, Blackwell 10.x/12.x):
  :func:`check_gpu` refuses anything older with the reason, before parsing.
- The engine inspector must be able to describe the layers, so the profiling verbosity is
  ``DETAILED`` (:func:`configure`); after the build, :func:`inspect_engine` deserialises the
  engine and requires one plugin layer per QKNormRoPE node and at least one layer that runs in
  FP8 (an FP8 input/output format, or an e4m3 tactic), so an engine where TensorRT dropped the
  quantisation is an error, not a slower FP16 engine.
"""

from __future__ import annotations

import json
import re
from typing import Any, Sequence

from qkrope.errors import QkropeError

#: The oldest compute capability with FP8 tensor-core GEMMs (Ada Lovelace).
FP8_MIN_COMPUTE_CAPABILITY = (8, 9)
_FP8_MARK = re.compile(r"\bfp8\b|e4m3", re.IGNORECASE)


class Fp8EngineError(QkropeError, RuntimeError):
    """The FP8 engine cannot be built here, or the built engine does not run in FP8."""


def quantization_of(model) -> dict | None:
    """The model's quantisation record (sidecar config ``quantization``), or None."""
    config = getattr(model, "config", None)
    record = getattr(config, "quantization", None)
    return record or None


def _capability(gpu: dict | None) -> tuple[int, int] | None:
    if not gpu or not gpu.get("compute_capability"):
        return None
    major, minor = str(gpu["compute_capability"]).split(".")[:2]
    return int(major), int(minor)


def check_gpu(gpu: dict | None, onnx_path) -> None:
    """Refuse a GPU below compute capability 8.9 (or none) for an FP8 model."""
    cc = _capability(gpu)
    need = ".".join(map(str, FP8_MIN_COMPUTE_CAPABILITY))
    if cc is None:
        raise Fp8EngineError(
            f"{onnx_path} is an FP8 model and no CUDA GPU was found to build it for; FP8 "
            f"engines need compute capability {need} or later (Ada, Hopper, Blackwell). Fix: "
            f"build on such a GPU")
    if cc < FP8_MIN_COMPUTE_CAPABILITY:
        raise Fp8EngineError(
            f"{onnx_path} is an FP8 model, but {gpu.get('name', 'this GPU')} has compute "
            f"capability {cc[0]}.{cc[1]}: TensorRT's FP8 GEMMs need {need} or later (Ada, Hopper, "
            f"Blackwell). Fix: build on such a GPU, or export without --quant for this one")


def check_options(opts) -> None:
    """Options an FP8 build cannot honour."""
    if getattr(opts, "refit", False):
        raise Fp8EngineError("--refit is not available for an FP8 model: its quantised weights "
                             "are FP8 constants behind DequantizeLinear, not the float "
                             "parameters refit replaces. Fix: re-quantise, re-export and rebuild")
    verbosity = getattr(opts, "profiling_verbosity", None)
    if verbosity not in (None, "detailed"):
        raise Fp8EngineError(f"an FP8 build needs --profiling-verbosity detailed (the engine "
                             f"inspector then shows which layers run in FP8); got {verbosity}")


def configure(trt, config) -> None:
    """The builder config of an FP8 build: detailed profiling verbosity, no precision flag."""
    config.profiling_verbosity = trt.ProfilingVerbosity.DETAILED


def _layers(info: Any) -> list[dict]:
    layers = info.get("Layers", []) if isinstance(info, dict) else []
    return [layer for layer in layers if isinstance(layer, dict)]


def _is_fp8_layer(layer: dict) -> bool:
    formats = [t.get("Format/Datatype", "") for key in ("Inputs", "Outputs")
               for t in layer.get(key, []) if isinstance(t, dict)]
    return any(_FP8_MARK.search(str(f)) for f in formats) or bool(
        _FP8_MARK.search(str(layer.get("TacticName", ""))))


def inspect_engine(trt, logger, serialized, node_names: Sequence[str]) -> dict[str, Any]:
    """Deserialise the engine, read the engine inspector's layer information (JSON) and require
    one plugin layer per QKNormRoPE node and at least one FP8 layer; returns the counts."""
    runtime = trt.Runtime(logger)
    engine = runtime.deserialize_cuda_engine(bytes(serialized))
    if engine is None:
        raise Fp8EngineError("TensorRT could not deserialise the engine it just built, so its "
                             "layers cannot be checked for FP8 (see its log above)")
    inspector = engine.create_engine_inspector()
    text = inspector.get_engine_information(trt.LayerInformationFormat.JSON)
    try:
        layers = _layers(json.loads(text))
    except ValueError as exc:
        raise Fp8EngineError(f"the engine inspector's layer information is not JSON ({exc})") \
            from exc
    if not layers:
        raise Fp8EngineError("the engine inspector lists no layer details (the engine was not "
                             "built with ProfilingVerbosity.DETAILED), so FP8 cannot be "
                             "verified")
    plugins = [layer for layer in layers if "plugin" in str(layer.get("LayerType", "")).lower()]
    missing = [n for n in node_names
               if not any(n in str(layer.get("Name", "")) for layer in plugins)]
    if missing:
        raise Fp8EngineError(f"the engine has no plugin layer for the QKNormRoPE node(s) "
                             f"{list(missing)[:4]} ({len(plugins)} plugin layer(s) of "
                             f"{len(layers)} layers)")
    fp8 = [layer for layer in layers if _is_fp8_layer(layer)]
    if not fp8:
        raise Fp8EngineError(f"none of the engine's {len(layers)} layers runs in FP8 (no FP8 "
                             f"tensor format, no e4m3 tactic): TensorRT dropped the "
                             f"quantisation. Check the TensorRT version (FP8 Q/DQ needs 10.x "
                             f"on compute capability 8.9+) and its build log")
    return {"layers": len(layers), "plugin_layers": len(plugins), "fp8_layers": len(fp8)}


__all__ = ["FP8_MIN_COMPUTE_CAPABILITY", "Fp8EngineError", "quantization_of", "check_gpu",
           "check_options", "configure", "inspect_engine"]
