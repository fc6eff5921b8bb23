"""What a loaded model accepts (:class:`qkrope.model_io.ModelIO`), read from an ONNX file (its
graph or session and its sidecar) or from a deserialised TensorRT engine (and its sidecar). The
runners of both backends build their checks from it.
"""

from __future__ import annotations

import os
from qkrope import dtypes
from qkrope.model_io import ModelIO, assign_roles, spec_from_shape
from qkrope.sidecars import EngineInfo, ModelConfig, ModelInfo, sidecar_path

from . import onnx_file


def onnx_model_io(path: str | os.PathLike, session=None, *, model=None) -> ModelIO:
    """ModelIO of an ONNX file: names/dtypes/shapes from the graph (or a session), axis names and
    head_dim from the sidecar when present (``model``: the file's ModelProto, already read)."""
    desc = ModelInfo.describe(path)
    sidecar_head_dim = desc.config.head_dim  # checked when the sidecar was read
    inputs_src = [(t.name, t.dtype, t.shape) for t in desc.inputs]
    # the roles the sidecar records (guessed below for a model without one, or one whose
    # sidecar names other inputs than the session)
    roles = desc.roles() if sidecar_path(path).exists() else None
    outputs_src = [(t.name, t.dtype, t.shape) for t in desc.outputs]
    if session is not None:
        # The session's view is authoritative for names and dtypes.
        sess_in = {i.name: i for i in session.get_inputs()}
        sess_out = {o.name: o for o in session.get_outputs()}
        if set(sess_in) != {name for name, _, _ in inputs_src}:
            roles = None
            inputs_src = [(i.name, dtypes.canonical(i.type, source="onnxruntime"),
                           [d if isinstance(d, (int, str)) else None for d in i.shape])
                          for i in session.get_inputs()]
        else:
            inputs_src = [(name, dtypes.canonical(sess_in[name].type, source="onnxruntime"), shape)
                          for name, _, shape in inputs_src]
        if set(sess_out) != {name for name, _, _ in outputs_src}:
            outputs_src = [(o.name, dtypes.canonical(o.type, source="onnxruntime"),
                            [d if isinstance(d, (int, str)) else None for d in o.shape])
                           for o in session.get_outputs()]
    inputs = [spec_from_shape(*t) for t in inputs_src]
    outputs = [spec_from_shape(*t) for t in outputs_src]
    head_dim = sidecar_head_dim or onnx_file.head_dim_from_onnx(path, model)
    if roles is None:
        roles = assign_roles(inputs)
    return ModelIO(inputs, outputs, int(head_dim) if head_dim else None, roles,
                   source=desc.source or str(path), config=desc.config)


def engine_model_io(engine, trt, sidecar: EngineInfo | None, *,
                    profile: int | None = None, roles: bool = True) -> ModelIO:
    """ModelIO of a deserialised engine: names, dtypes, per input the min/max of ``profile``
    (default: the union of every optimisation profile, so that the checks before a call accept
    what some profile accepts; the TensorRT runner then picks the profile); axis names and the
    model config from its sidecar when there is one. ``roles=False``: a graph that is no
    transformer (a pipeline stage's engine), whose inputs have no runner roles."""
    sym = {}
    if sidecar is not None:
        for item in sidecar.inputs + sidecar.outputs:
            if item.axes:
                sym[item.name] = item.axes
    n_profiles = max(int(getattr(engine, "num_optimization_profiles", 1)), 1)
    chosen = range(n_profiles) if profile is None else [profile]
    inputs, outputs = [], []
    for i in range(engine.num_io_tensors):
        name = engine.get_tensor_name(i)
        dtype = dtypes.canonical(engine.get_tensor_dtype(name), source="tensorrt")
        shape = [int(d) for d in engine.get_tensor_shape(name)]
        axes = sym.get(name)
        shape_sym = [(axes[j] if axes and j < len(axes) and axes[j] and d < 0 else d)
                     for j, d in enumerate(shape)]
        if engine.get_tensor_mode(name) == trt.TensorIOMode.INPUT:
            los, his = [], []
            for k in chosen:
                lo, _opt, hi = engine.get_tensor_profile_shape(name, k)
                los.append([int(d) for d in lo])
                his.append([int(d) for d in hi])
            lo = [min(c) for c in zip(*los)]
            hi = [max(c) for c in zip(*his)]
            inputs.append(spec_from_shape(name, dtype, shape_sym, bounds=(lo, hi)))
        else:
            outputs.append(spec_from_shape(name, dtype, shape_sym))
    config = sidecar.config if sidecar is not None else ModelConfig()
    head_dim = config.head_dim  # checked when the sidecar was read
    names = {s.name for s in inputs}
    named: dict[str, str] | None = {}
    if roles:
        named = sidecar.roles() if sidecar is not None else None
        if named is None or not set(named.values()) <= names:  # no sidecar, or another engine's
            named = assign_roles(inputs)
    return ModelIO(inputs, outputs, int(head_dim) if head_dim else None, named,
                   source=sidecar.onnx if sidecar is not None else "the engine", config=config,
                   profile_bounds=True)

