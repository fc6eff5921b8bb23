"""The typed descriptions of models and engines: the two sidecar files, one writer and one reader
each, a format version, and a check on load.

``M.onnx.json`` (:class:`ModelInfo`), written by ``qkrope export`` next to every model and read by
``qkrope build``, ``qkrope check``, the runner and the benchmark::

    {
      "format": "qkrope-onnx", "format_version": 2 (1 is read too: no roles, eps/interleaved/
                                                   rounding also in config),
      "model": "attention" | "transformer",
      "opset": 18, "ir_version": 10,
      "dtype": "fp32" | "fp16" | "bf16",                 # weights and activations
      "inputs":  [{"name": str, "dtype": "float32"|"float16"|"bfloat16"|"bool"|...,
                   "shape": [int | axis-name str, ...],
                   "role": "hidden_states" | "img_cache" | ... (qkrope.model_io.ROLES) }, ...],
                                                                   # graph order
      "outputs": [same],
      "dynamic_axes": {"batch": {"export_value": 2}, "img_tokens": {...}, "txt_tokens": {...},
                       "img_cache_rows": {...}, "txt_cache_rows": {...}},
      "node_attributes": {"epsilon": 1e-06, "interleaved": 1, "rounding": 0,
                          "plugin_version": "1", "plugin_namespace": "qkrope"},
                         (the nodes' values, stored only here: contract.NodeAttributes)
      "config": {"dim", "heads", "head_dim", "rotary_dim", "axes_dims_rope", "seed", "dtype",
                 "attention", "weights" (path), "weights_sha256",
                 "parameters" (the state-dict keys kept as initializers of that name),
                 "parameter_shapes" ({key: shape}: `qkrope refit` checks them),
                 ... transformers add "diffusers_dir", "diffusers_config" (the model's config
                 dict), "num_layers_exported", "parameters_not_in_graph", "family"
                 (a family's name: qkrope.families.names()) and "rope_theta"
                 (axes_dims_rope has one entry per RoPE axis); an FP8 export
                 "quantization"}  (read as a checked ModelConfig; every field optional)
      "sample": {"img_shapes": [[f, h, w], ...], "txt_len": int, "batch": int},
      "versions": {"qkrope", "torch", "onnx", "onnxscript", "onnxruntime"?, "diffusers"?},
      "model_sha256": sha256 hex of the M.onnx it describes (checked by ModelInfo.load: a sidecar
                      next to another model is "sidecar does not describe this model"; written
                      by save() whenever the model file exists; null/absent: not checked)
      "model_file": {"sha256", "size", "mtime_ns", "ino"} | null  (the model file as written:
                    a load compares size/mtime_ns/inode and hashes only on a difference,
                    qkrope.file_record),
      "external_data": {location: {"sha256", "size", "mtime_ns", "ino"}}  (each data file),
      "write_id": 16 hex digits | null (also the model's metadata_props qkrope.write_id: a pair
                  from two writers is refused)
    }

``M.engine.json`` (:class:`EngineInfo`), written by ``qkrope build`` next to the engine and read
by the TensorRT runner and ``qkrope triton-repo``::

    {
      "format": "qkrope-engine", "format_version": 2 (1 is read too: no roles),
      "tensorrt_version": str, "gpu": {"name", "compute_capability", "index"} | null,
      "onnx": absolute path of the source model,
      "inputs":  [{"name", "dtype", "shape": [int, -1 = dynamic], "axes"?: [axis name | null],
                   "role"?: the model sidecar's role}],
      "outputs": [same],
      "profiles": [{input name: {"min": [...], "opt": [...], "max": [...]}}],
      "plugin": {"path", "sha256", "serialized_in_engine"} | null (no plugin: function body),
      "plugin_layers": int, "version_compatible": bool, "strongly_typed": bool,
      "builder_optimization_level": int | null, "parser_flags": [str],
      "config", "dynamic_axes", "sample": copied from the model's sidecar,
      "build_seconds": float | null, "created": "YYYY-mm-ddTHH:MM:SSZ",
      "refittable": bool, "refit_mode": "individual" | "all" | null,
      "profile_labels": ["1024x1024" per profile, or ""],
      "engine_sha256": sha256 hex of the engine it describes (checked by EngineInfo.load, so
                       by the runner, `qkrope refit` and `qkrope triton-repo`: an engine beside
                       another engine's sidecar is refused; written by save() whenever the
                       engine file exists; null/absent: not checked)
      "engine_file": {"sha256", "size", "mtime_ns", "ino"} | null (as the model's model_file),
      "write_id": 16 hex digits | null (also in the engine's network name: <config tag>.write-<id>)
      "build_key": {"model_sha256", "options", "tensorrt_version", "gpu", "plugin_sha256",
                    "engine_sha256"} | null
                   (what the engine was built from; `qkrope build` reuses the engine when all
                   of it is unchanged)
    }

The engine itself keeps a tag of the model config it was built from as its network name
(:func:`config_tag`, ``ICudaEngine.name``); the runner and ``qkrope refit`` check the sidecar's
``config`` against it after deserialising (:meth:`EngineInfo.check_engine_name`).

Dtype names are numpy's (``"bfloat16"`` is ml_dtypes' name, :mod:`qkrope.dtypes`). A file of
another format or version, a missing or mistyped field, is a :class:`SidecarError` naming the file
and what is wrong (never a KeyError).

The package holds one module per subject: :mod:`.formats` (names, versions, errors, paths),
:mod:`.fields` (the checked reader), :mod:`.files` (the files a sidecar describes, the ONNX
header), :mod:`.config` (:class:`ModelConfig`, the node attributes, the model's own metadata),
:mod:`.model` (:class:`ModelInfo`), :mod:`.engine` (:class:`EngineInfo`) and :mod:`.tags` (the
engine's network-name tags). Every name is imported from here.
"""

from __future__ import annotations

from qkrope.file_record import full_by_default  # noqa: F401 (the loaders' QKROPE_VERIFY default)

from .config import ModelConfig
from .engine import EngineInfo, EngineTensor, PluginRecord, engine_tensors
from .files import onnx_header, onnx_metadata_props
from .formats import (AXES, DTYPES, ENGINE_FORMAT, FORMAT_VERSION, LEVELS, METADATA_PREFIX,
                      MODELS, ONNX_FORMAT, READ_VERSIONS, EngineInfoError, ModelInfoError,
                      SidecarError, engine_sidecar_path, sidecar_path)
from .model import ModelInfo, TensorInfo
from .tags import (CONFIG_TAG_PREFIX, FACTS_TAG_PREFIX, WRITE_ID_SEPARATOR, config_tag,
                   engine_facts, engine_file_tags, engine_network_name, facts_tag)

__all__ = ["FORMAT_VERSION", "ONNX_FORMAT", "ENGINE_FORMAT", "SidecarError", "ModelInfoError",
           "EngineInfoError", "ModelConfig", "TensorInfo", "ModelInfo", "EngineTensor", "PluginRecord",
           "EngineInfo", "engine_tensors", "sidecar_path", "engine_sidecar_path", "config_tag",
           "facts_tag", "engine_facts", "engine_file_tags"]
