"""``qkrope check`` of an FP8 export (``qkrope export --quant fp8``) on the CPU.

ONNX Runtime runs the model with ``session.disable_quant_qdq=1`` (its Q/DQ as written; see
:data:`qkrope.quantization.ORT_QDQ_OPTION`), with every quantised Linear's input-quantizer output
and input as extra graph outputs. The reference is ModelOpt's own fake-quantised PyTorch model:
the quantised folder recorded at export, restored with ModelOpt, run through diffusers' own
forward with the same inputs. Three comparisons:

1. **Weights, bit for bit**: each ``DequantizeLinear(W8, s_w)`` equals ModelOpt's
   ``weight_quantizer(W)``. Both are ``fp8(W * (448/amax)) * (1/(448/amax))`` in float32 from the
   same W, so they are identical or the export is wrong (0 mismatches allowed).
2. **Each activation quantizer, where the graph matches**: ModelOpt's ``input_quantizer`` applied
   to ONNX Runtime's own input of that QuantizeLinear must give ONNX Runtime's dequantised values.
   The one arithmetic difference: ONNX's QuantizeLinear divides by the scale ``s = 1/(448/amax)``
   where ModelOpt multiplies by ``448/amax``; the two float32 results differ by at most one ulp,
   which changes the FP8 value only when they straddle a rounding midpoint (measured: 1 element
   in 8e6). So every mismatch must be exactly one FP8 step (``|a - b| = ulp_e4m3(value) * s``)
   and they are counted; any other difference fails.
3. **End to end against ModelOpt's fake-quant model**: ModelOpt's model runs once more with
   each input quantizer's output replaced by ONNX Runtime's FP8 values for it (which comparison 2
   showed to be that quantizer's own output on ONNX Runtime's input). What is left between the
   two runs is float32 summation order, as for the float export: <= 1e-4 x max|output| through a
   transformer (tiny_pipeline.TRANSFORMER_PARITY, derived there); that bound is asserted. The
   plain run of ModelOpt's model is compared too and reported, not asserted: the quantizers'
   inputs differ between the two runs by that float noise, and an input that straddles an FP8
   rounding midpoint between them (counted as ``crossings``) changes by one FP8 step, which the
   later layers spread.

The difference to the unquantised model (quantizers disabled) is reported, never asserted: it is
the quantisation error itself.
"""

from __future__ import annotations

import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import numpy as np

from qkrope.errors import InputError

#: The float export's transformer bound (qkrope.apps.tiny_pipeline.TRANSFORMER_PARITY, derived
#: there), relative to max |reference|.
FLOAT_PARITY = 1e-4


@dataclass
class Fp8Report:
    weights_checked: int = 0
    weight_mismatches: int = 0
    quantizers_checked: int = 0
    elements: int = 0
    tie_flips: int = 0            # one-step differences of comparison 2 (rounding ties)
    bad_quantizer_elements: int = 0  # any other difference of comparison 2
    crossings: int = 0            # elements whose FP8 value differs between ORT and PyTorch
    max_abs_vs_modelopt: float = 0.0  # ModelOpt's model, its quantizers fed ORT's FP8 values
    max_abs_vs_modelopt_free: float = 0.0  # ModelOpt's model as it is
    ref_scale: float = 0.0
    max_abs_vs_float: float = 0.0
    bound: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return (self.weight_mismatches == 0 and self.bad_quantizer_elements == 0
                and self.max_abs_vs_modelopt <= self.bound)

    def lines(self) -> list[str]:
        out = [
            f"weights: {self.weights_checked} FP8 weights, {self.weight_mismatches} elements "
            f"differ from ModelOpt's fake-quantised weights (bound 0)",
            f"activation quantizers: {self.quantizers_checked} checked on {self.elements} "
            f"elements, {self.tie_flips} one-step rounding ties, {self.bad_quantizer_elements} "
            f"other differences (bound 0)",
            f"vs ModelOpt fake-quant PyTorch, quantizers fed ONNX Runtime's FP8 values: max abs "
            f"{self.max_abs_vs_modelopt:.3g} (bound {self.bound:.3g} = 1e-4 x max |ref| "
            f"{self.ref_scale:.3g})",
            f"vs ModelOpt fake-quant PyTorch as it is (reported only): max abs "
            f"{self.max_abs_vs_modelopt_free:.3g}; FP8 values differing between the runs "
            f"(rounding crossings): {self.crossings}",
            f"vs the unquantised model (reported only): max abs {self.max_abs_vs_float:.3g}",
        ]
        return out + self.notes


def _fp8_step(values: np.ndarray, scale: float) -> np.ndarray:
    """The spacing of float8 e4m3fn at each dequantised value (value / scale), times scale."""
    q = np.abs(values / scale)
    exp = np.floor(np.log2(np.maximum(q, 2.0 ** -6)))  # subnormals share the 2^-6 binade
    return (2.0 ** (exp - 3)) * scale


def check_fp8_model(onnx_path, info, *, feeds: dict[str, np.ndarray], img_shapes,
                    diffusers_dir: str | None = None, out=None) -> Fp8Report:
    """Run the three comparisons of the module docstring; prints a summary to ``out``."""
    import onnx
    import onnxruntime as ort
    import torch

    from qkrope import quantization
    from qkrope.export import quantize
    from qkrope.export.patch_diffusers import load_transformer
    from qkrope import families

    out = out if out is not None else sys.stdout
    record = info.config.quantization or {}
    if record.get("mode") != "fp8":
        raise InputError(f"{onnx_path}: quantisation {record.get('mode')!r} is not checked here")
    if info.dtype != "fp32":
        raise InputError(f"{onnx_path} is a {info.dtype} FP8 export; the CPU check compares fp32 "
                         f"exports only (ONNX Runtime's CPU provider has no bf16 Q/DQ, and the "
                         f"bit-for-bit comparisons assume ModelOpt's float32 arithmetic). Fix: "
                         f"export the same folder with --dtype fp32 to check it")
    folder = diffusers_dir or info.config.diffusers_dir
    if not folder:
        raise InputError(f"{onnx_path}: the sidecar names no quantised diffusers folder; pass "
                         f"--diffusers QDIR (the folder `qkrope quantize` wrote)")
    model = load_transformer(str(folder), quant="fp8")
    modules = dict(model.named_modules())
    family = families.by_name(info.config.family, source=f"the sidecar {info.source}")
    exported = info.config.num_layers_exported
    # the blocks the export kept, list by list in execution order (FLUX: double, then single)
    kept = family.kept_blocks(model.config, int(exported) if exported else None)
    report = Fp8Report()

    proto = onnx.load(str(onnx_path))
    from onnx import numpy_helper

    inits = {t.name: t for t in proto.graph.initializer}
    linears = list(record["quantized_linears"])
    # 1. weights
    consumers = {i: n for n in proto.graph.node for i in n.input}
    for owner in linears:
        lin = modules[owner]
        w8 = numpy_helper.to_array(inits[f"{owner}.weight_fp8"]).astype(np.float32)
        s_w = numpy_helper.to_array(inits[f"{owner}.weight_quantizer.scale"]).astype(np.float32)
        dq = w8 * s_w
        if consumers[consumers[f"{owner}.weight_fp8"].output[0]].op_type == "MatMul":
            dq = dq.T
        with torch.no_grad():
            want = lin.weight_quantizer(lin.weight.float()).numpy()
        report.weights_checked += 1
        report.weight_mismatches += int((dq != want).sum())

    # ORT with the quantizers' inputs and outputs as extra outputs
    q_nodes = {n.name: n for n in proto.graph.node if n.op_type == "QuantizeLinear"}
    extra = []
    for owner in linears:
        q = q_nodes[f"{owner}.input_quantize"]
        extra += [q.input[0], f"{owner}.input_dequantized"]
    existing = {o.name for o in proto.graph.output}
    for name in extra:
        if name not in existing:
            proto.graph.output.append(onnx.ValueInfoProto(name=name))
            existing.add(name)
    so = ort.SessionOptions()
    so.add_session_config_entry(*quantization.ORT_QDQ_OPTION)
    with tempfile.TemporaryDirectory() as tmp:
        probe = Path(tmp) / "probe.onnx"
        onnx.save(proto, str(probe))
        sess = ort.InferenceSession(str(probe), so, providers=["CPUExecutionProvider"])
        names = [o.name for o in sess.get_outputs()]
        outputs = dict(zip(names, sess.run(None, {k: np.asarray(v) for k, v in feeds.items()})))

    # PyTorch: ModelOpt's model, diffusers' own forward, quantizer outputs recorded
    captured: dict[str, torch.Tensor] = {}
    hooks = []
    for owner in linears:
        qz = modules[owner].input_quantizer
        hooks.append(qz.register_forward_hook(
            lambda _m, _i, o, owner=owner: captured.__setitem__(owner, o.detach().clone())))
    t = {role: torch.from_numpy(np.asarray(feeds[name])) for role, name in info.roles().items()}
    # blocks past an export's --layers pass their streams through (the check's reference does
    # the same: every other module, and count-dependent buffers, stay the whole model's)
    from qkrope.apps.check_blocks import pass_through

    skipped = []
    for blocks, keep in zip(family.block_lists, kept):
        listed = model.get_submodule(blocks.attr)
        for j in range(keep, len(listed)):
            skipped.append((listed, j, listed[j]))
            listed[j] = pass_through(listed[j], blocks.returns)
    try:
        # the family's reference forward (qkrope/families/<family>/reference.py), its output in
        # the graph's layout where diffusers' differs (the hook's graph_output, as the float
        # check applies it: a 5-D latent or per-sample latents as the graph's packed tokens)
        reference = families.hooks(family, "reference")
        kw = reference.forward_kwargs(info, t, img_shapes)

        def sample_of(result) -> np.ndarray:
            sample = result[0]
            if hasattr(reference, "graph_output"):
                sample = reference.graph_output(info, sample, img_shapes)
            return sample.float().numpy()

        with torch.no_grad():
            free = sample_of(model(**kw))
            for h in hooks:
                h.remove()
            hooks = [modules[o].input_quantizer.register_forward_hook(
                lambda _m, _i, o_, owner=o: torch.from_numpy(
                    outputs[f"{owner}.input_dequantized"]).to(o_.dtype).reshape(o_.shape))
                for o in linears]
            ref = sample_of(model(**kw))
            for h in hooks:
                h.remove()
            with quantize.quantizers_disabled(model):
                flt = sample_of(model(**kw))
    finally:
        for h in hooks:
            h.remove()
        for listed, j, block in skipped:
            listed[j] = block

    # 2. each activation quantizer on ORT's own input; 3. FP8 crossings between the runs
    for owner in linears:
        x = outputs[q_nodes[f"{owner}.input_quantize"].input[0]]
        got = outputs[f"{owner}.input_dequantized"]
        with torch.no_grad():
            want = modules[owner].input_quantizer(torch.from_numpy(x)).numpy()
        s_x = float(numpy_helper.to_array(inits[f"{owner}.input_quantizer.scale"]))
        diff = got != want
        n = int(diff.sum())
        if n:
            step = _fp8_step(np.maximum(np.abs(got[diff]), np.abs(want[diff])), s_x)
            gap = np.abs(got[diff] - want[diff])
            one = np.isclose(gap, step, rtol=1e-6, atol=0) | np.isclose(gap, step / 2, rtol=1e-6,
                                                                          atol=0)
            report.tie_flips += int(one.sum())
            report.bad_quantizer_elements += int((~one).sum())
        report.quantizers_checked += 1
        report.elements += int(got.size)
        if owner in captured:
            report.crossings += int((captured[owner].numpy() != got).sum())
        else:
            report.notes.append(f"note: {owner} did not run in the PyTorch model")
    sample = outputs[info.output_names[0]]
    report.ref_scale = float(np.abs(ref).max())
    report.max_abs_vs_modelopt = float(np.abs(sample - ref).max())
    report.max_abs_vs_modelopt_free = float(np.abs(sample - free).max())
    report.max_abs_vs_float = float(np.abs(sample - flt).max())
    report.bound = FLOAT_PARITY * report.ref_scale
    print(f"qkrope check (FP8): {onnx_path}; reference: ModelOpt fake-quant {folder}", file=out)
    for line in report.lines():
        print("  " + line, file=out)
    print(f"qkrope check: {'PASSED' if report.passed else 'FAILED'}", file=out)
    return report


def check_fp8(onnx_path, *, img_shapes: Sequence[Sequence[int]], txt_len: int, batch: int,
              seed: int = 0, diffusers_dir: str | None = None, out=None) -> Fp8Report:
    """:func:`check_fp8_model` with deterministic inputs of these sizes
    (:func:`qkrope.runtime.inputs.make_inputs`)."""
    from qkrope.runtime.inputs import make_inputs
    from qkrope.runtime.onnx_file import checked_onnx_model
    from qkrope.sidecars import ModelInfo

    checked_onnx_model(str(onnx_path))
    info = ModelInfo.load(onnx_path, full=True)  # qkrope check: the full hash
    feeds = make_inputs(info, img_shapes, txt_len, batch, seed=seed)
    return check_fp8_model(onnx_path, info, feeds=feeds, img_shapes=img_shapes,
                           diffusers_dir=diffusers_dir, out=out)


__all__ = ["Fp8Report", "check_fp8", "check_fp8_model", "FLOAT_PARITY"]
