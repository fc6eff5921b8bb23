"""The QKNormRoPE op alone through torch.onnx and the portable function body
(export/onnx_function.py): every variant (NeoX, partial rotary, rounding=1 and 2, every
activation dtype) run by ONNX Runtime against the PyTorch reference, and one model refusing two variants."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from qkrope import contract
from qkrope.export import qk_norm_rope_reference
from qkrope.export.onnx_export import ExportError, finalize_model
from qkrope.export.onnx_function import (FunctionVariant, function_variant,
                                         qk_norm_rope_translation)
from qkrope.runtime.inputs import from_ort_value, from_torch, to_ort_value, to_torch


def _run(path, feeds, providers=("CPUExecutionProvider",)):
    sess = ort.InferenceSession(str(path), providers=list(providers))
    outs = sess.run_with_ort_values(None, {k: to_ort_value(v) for k, v in feeds.items()})
    return [from_ort_value(o) for o in outs]


class _OpOnly(torch.nn.Module):
    def __init__(self, interleaved, rounding):
        super().__init__()
        self.interleaved, self.rounding = interleaved, rounding

    def forward(self, q, k, q_weight, k_weight, cos_sin_cache):
        from qkrope.export import qk_norm_rope

        return qk_norm_rope(q, k, q_weight, k_weight, cos_sin_cache, eps=1e-5,
                            interleaved=self.interleaved, rounding=self.rounding)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("interleaved,rounding,rotary_dim", [
    (True, 0, 64), (True, 1, 64), (False, 0, 64), (True, 0, 48), (False, 1, 32),
    (True, 2, 64), (False, 2, 48)])
def test_function_body_variants(tmp_path, dtype, interleaved, rounding, rotary_dim):
    """The op alone: the function body (ONNX Runtime) vs the PyTorch reference, for NeoX,
    partial rotary, rounding=1 and 2, and every activation dtype (bf16 included: the body only needs
    Cast/elementwise kernels, which ONNX Runtime's CPU provider has for bf16)."""
    g = torch.Generator().manual_seed(5)
    q = (torch.randn(2, 7, 3, 64, generator=g) * 3).to(dtype)
    k = torch.randn(2, 7, 3, 64, generator=g).to(dtype)
    qw = (1 + 0.3 * torch.randn(64, generator=g)).to(dtype)
    kw = (1 + 0.3 * torch.randn(64, generator=g)).to(dtype)
    angles = torch.randn(9, rotary_dim // 2, generator=g) * 3
    cache = torch.cat([angles.cos(), angles.sin()], -1)
    with torch.no_grad():
        program = torch.onnx.export(
            _OpOnly(interleaved, rounding), (q, k, qw, kw, cache), dynamo=True,
            input_names=list(contract.INPUTS), output_names=list(contract.OUTPUTS),
            custom_translation_table={
                torch.ops.qkrope.qk_norm_rope.default: qk_norm_rope_translation},
            verbose=False)
    model = finalize_model(program.model, opset=18, head_dim=64, rotary_dim=rotary_dim,
                           expected_nodes=1)
    import onnx_ir as ir

    path = tmp_path / "op.onnx"
    ir.save(model, path)
    onnx.checker.check_model(str(path), full_check=True)
    # the body's variant is read from what the exporter recorded, not from its node names
    assert function_variant(onnx.load(str(path))) == FunctionVariant(
        bool(interleaved), int(rounding), rotary_dim < 64)
    feeds = {n: from_torch(t) for n, t in zip(contract.INPUTS, (q, k, qw, kw, cache))}
    got = _run(path, feeds)
    ref = qk_norm_rope_reference(q, k, qw, kw, cache, eps=1e-5, interleaved=interleaved,
                                 rounding=rounding)
    for g_out, r in zip(got, ref):
        g_t = to_torch(g_out).float()
        r = r.float()
        scale = r.abs().max().item()
        tol = {torch.float32: 2e-6 * scale, torch.float16: 2.0 ** (np.log2(scale) // 1 - 10),
               torch.bfloat16: 2.0 ** (np.log2(scale) // 1 - 7)}[dtype]
        assert (g_t - r).abs().max().item() <= tol
        if dtype != torch.float32:  # at most one rounding step apart, and rarely
            assert (g_t != r).float().mean().item() < 0.05


@pytest.mark.parametrize("dtype,rounding,weights_fp32", [
    (torch.bfloat16, 0, False), (torch.bfloat16, 1, False), (torch.bfloat16, 2, False),
    (torch.float16, 2, False), (torch.bfloat16, 0, True), (torch.bfloat16, 1, True),
    (torch.float16, 2, True)])
def test_function_body_bit_exact_where_the_sum_of_squares_is_exact(tmp_path, dtype, rounding,
                                                                   weights_fp32):
    """Grid inputs (tests/_kernel_cases.py: x = k/16, an exact fp32 sum of squares): the body's
    ReduceMean/Sqrt/Reciprocal and the reference's mean/rsqrt are then the same correctly rounded
    values, so each mode's body gives the reference's bits exactly; the three modes differ from
    one another on these inputs (the check can tell them apart). Also with float32 weights under
    16-bit activations (the node's W type; FLUX.3): the model's weight inputs are FLOAT."""
    from _kernel_cases import make_inputs

    q, k, qw, kw, cache = make_inputs(dtype, 64, 64, batch=2, seq=6, heads=3, grid=True, seed=3,
                                      weights_fp32=weights_fp32)
    with torch.no_grad():
        program = torch.onnx.export(
            _OpOnly(True, rounding), (q, k, qw, kw, cache), dynamo=True,
            input_names=list(contract.INPUTS), output_names=list(contract.OUTPUTS),
            custom_translation_table={
                torch.ops.qkrope.qk_norm_rope.default: qk_norm_rope_translation},
            verbose=False)
    model = finalize_model(program.model, opset=18, head_dim=64, rotary_dim=64, expected_nodes=1)
    import onnx_ir as ir

    path = tmp_path / "op.onnx"
    ir.save(model, path)
    onnx.checker.check_model(str(path), full_check=True)
    graph_inputs = {i.name: i.type.tensor_type.elem_type for i in onnx.load(str(path)).graph.input}
    assert graph_inputs["q_weight"] == (onnx.TensorProto.FLOAT if weights_fp32 else
                                        graph_inputs["q"])
    got = _run(path, {n: from_torch(t) for n, t in zip(contract.INPUTS, (q, k, qw, kw, cache))})
    modes = {m: qk_norm_rope_reference(q, k, qw, kw, cache, eps=1e-5, rounding=m)
             for m in contract.ROUNDING_MODES}
    for g_out, r in zip(got, modes[rounding]):
        assert torch.equal(to_torch(g_out), r)
    for other in set(contract.ROUNDING_MODES) - {rounding}:
        assert not torch.equal(modes[other][0], modes[rounding][0]), other


def test_mixed_variants_refused():
    class _Two(torch.nn.Module):
        def forward(self, q, k, qw, kw, cache):
            from qkrope.export import qk_norm_rope

            a = qk_norm_rope(q, k, qw, kw, cache, interleaved=True)
            b = qk_norm_rope(q, k, qw, kw, cache, interleaved=False)
            return a[0] + b[0]

    args = (torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8), torch.ones(8), torch.ones(8),
            torch.randn(4, 8))
    with torch.no_grad():
        program = torch.onnx.export(_Two(), args, dynamo=True, verbose=False,
                                    custom_translation_table={
                                        torch.ops.qkrope.qk_norm_rope.default:
                                            qk_norm_rope_translation})
    with pytest.raises(ExportError, match="different interleaved/rounding"):
        finalize_model(program.model, opset=18, head_dim=8, rotary_dim=8)

