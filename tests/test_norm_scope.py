"""The norm_scope attribute (docs/spec.md section 3.2): one RMSNorm over a token's whole
``H * D`` row (Wan's ``torch.nn.RMSNorm(heads * head_dim)``) in the contract, the Python
reference, the torch op and the ONNX node with its function body (ONNX Runtime).

Bit-exactness: ``rounding=2`` with ``norm_scope=1`` is checked against diffusers' own
``WanAttnProcessor`` (q and k captured where they enter the attention), in bf16, fp16 and fp32."""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest
import torch

from _tiny_model import one_node_model

from qkrope import contract
from qkrope.contract import NodeAttributes
from qkrope.errors import InputError
from qkrope.export import qk_norm_rope, qk_norm_rope_reference
from qkrope.export.onnx_export import finalize_model
from qkrope.export.onnx_function import (FunctionVariant, function_variant, make_function_proto,
                                         qk_norm_rope_translation)

ROW = contract.NORM_SCOPE_ROW


# --------------------------------------------------------------------------------------------
# The contract
# --------------------------------------------------------------------------------------------

def test_contract_names_and_refusals():
    assert (contract.NORM_SCOPE_HEAD, contract.NORM_SCOPE_ROW) == (0, 1)
    assert contract.NORM_SCOPES == (0, 1)
    assert contract.ATTRIBUTE_BY_NAME["norm_scope"].onnx_type == "INT"
    assert ("norm_scope", "kINT32") in contract.PLUGIN_FIELDS
    for bad in (2, -1, True, 1.0, "1", None):
        with pytest.raises(InputError, match=r"^norm_scope must be 0 \(per head.*1 \(over the "
                                             r"token's flat row.*got"):
            NodeAttributes(norm_scope=bad)
    a = NodeAttributes(1e-6, True, 2, np.int64(1))
    assert a.norm_scope == 1 and type(a.norm_scope) is int


def test_left_off_at_zero_kept_at_one():
    """0 is never written (graphs and records of head-scope models stay as they were); 1 is
    written and read back."""
    assert "norm_scope" not in NodeAttributes().to_node()
    assert "norm_scope" not in contract.node_attributes()
    assert "norm_scope" not in NodeAttributes().as_kwargs()
    row = NodeAttributes(1e-6, True, 2, ROW)
    assert row.to_node()["norm_scope"] == 1 and row.as_kwargs()["norm_scope"] == 1
    assert NodeAttributes.from_node(row.to_node()) == row
    assert NodeAttributes.from_node(NodeAttributes().to_node()).norm_scope == 0
    assert contract.attribute_names_error(NodeAttributes().to_node()) is None
    assert contract.attribute_names_error(row.to_node()) is None
    assert "unknown attribute 'scope'" in contract.attribute_names_error(
        dict(row.to_node(), scope=1))


def test_node_validator():
    assert contract.validate_qknorm_rope_nodes(one_node_model(), where="m.onnx") == 1
    for scope in contract.NORM_SCOPES:
        assert contract.validate_qknorm_rope_nodes(one_node_model(norm_scope=scope),
                                                   where="m.onnx") == 1
    with pytest.raises(contract.NodeContractError, match=r"'norm_scope' = 2 is invalid: "
                                                         r"expected 0 \(per head"):
        contract.validate_qknorm_rope_nodes(one_node_model(norm_scope=2), where="m.onnx")
    with pytest.raises(contract.NodeContractError, match="'norm_scope' has type FLOAT"):
        contract.validate_qknorm_rope_nodes(one_node_model(norm_scope=1.0), where="m.onnx")


# --------------------------------------------------------------------------------------------
# The reference and the torch op
# --------------------------------------------------------------------------------------------

def _inputs(dtype, heads=5, head_dim=64, seq=7, batch=2, rotary_dim=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    rotary_dim = head_dim if rotary_dim is None else rotary_dim
    shape = (batch, seq, heads, head_dim)
    # heads of different scales: a row norm and per-head norms then differ
    scale = torch.linspace(0.25, 4.0, heads)[None, None, :, None]
    q = (torch.randn(shape, generator=g) * scale).to(dtype)
    k = (torch.randn(shape, generator=g) * 3 * scale).to(dtype)
    qw = (1 + 0.3 * torch.randn(heads * head_dim, generator=g)).to(dtype)
    kw = (1 + 0.3 * torch.randn(heads * head_dim, generator=g)).to(dtype)
    angles = torch.randn(seq + 2, rotary_dim // 2, generator=g, dtype=torch.float64) * 3
    cache = torch.cat([angles.cos(), angles.sin()], -1).float()
    return q, k, qw, kw, cache


def test_row_scope_is_one_norm_over_the_flat_row():
    """fp32: the reference's row scope is torch.nn.RMSNorm over [B, S, H*D], unflattened, then
    the head-scope op's rotation with unit weights (bit for bit: the same fp32 operations)."""
    q, k, qw, kw, cache = _inputs(torch.float32)
    b, s, h, d = q.shape
    out = qk_norm_rope_reference(q, k, qw, kw, cache, eps=1e-6, norm_scope=ROW)
    for x, w, o in ((q, qw, out[0]), (k, kw, out[1])):
        norm = torch.nn.RMSNorm(h * d, eps=1e-6)
        with torch.no_grad():
            norm.weight.copy_(w)
        y = norm(x.flatten(2)).unflatten(2, (h, d))
        half = d // 2
        c, n = cache[:s, :half][None, :, None], cache[:s, half:][None, :, None]
        a_, b_ = y[..., 0::2], y[..., 1::2]
        want = torch.stack((a_ * c - b_ * n, a_ * n + b_ * c), -1).flatten(-2)
        assert torch.equal(o, want)
    head = qk_norm_rope_reference(q, k, qw[:d], kw[:d], cache, eps=1e-6)
    assert not torch.allclose(head[0], out[0], atol=1e-3)  # the two scopes differ here


def test_op_checks_the_weight_width_and_traces():
    q, k, qw, kw, cache = _inputs(torch.float32, heads=3, head_dim=8)
    with pytest.raises(InputError, match=r"q_weight must be \[24\] in q's dtype \(torch.float32\) "
                                         r"or float32 \(heads \* head_dim, norm_scope 1"):
        qk_norm_rope(q, k, qw[:8], kw[:8], cache, norm_scope=ROW)
    with pytest.raises(InputError, match=r"q_weight must be \[8\] in q's dtype .* \(head_dim"):
        qk_norm_rope(q, k, qw, kw, cache)
    with pytest.raises(InputError, match="norm_scope must be"):
        qk_norm_rope(q, k, qw, kw, cache, norm_scope=2)
    got = qk_norm_rope(q, k, qw, kw, cache, norm_scope=ROW)
    want = qk_norm_rope_reference(q, k, qw, kw, cache, norm_scope=ROW)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def _wan_eager(x_flat, weight, cache, heads, eps, dtype):
    """q through diffusers' WanAttnProcessor (norm_q, unflatten, its apply_rotary_emb), captured
    where it enters the attention. ``cache`` [S, D] (cos half, sin half) becomes diffusers'
    repeat-interleaved (freqs_cos, freqs_sin) [1, S, 1, D]."""
    from diffusers.models.transformers import transformer_wan as tw

    dim = x_flat.shape[-1]
    attn = tw.WanAttention(dim=dim, heads=heads, dim_head=dim // heads, eps=eps,
                           processor=tw.WanAttnProcessor()).to(dtype)
    with torch.no_grad():
        attn.norm_q.weight.copy_(weight)
        attn.norm_k.weight.copy_(weight)
        for lin in (attn.to_q, attn.to_k, attn.to_v):  # identity projections: q = k = x
            lin.weight.copy_(torch.eye(dim))
            lin.bias.zero_()
    half = cache.shape[1] // 2
    freqs_cos = cache[:, :half].repeat_interleave(2, 1)[None, :, None]
    freqs_sin = cache[:, half:].repeat_interleave(2, 1)[None, :, None]
    seen = {}

    def capture(query, key, value, **kwargs):
        seen["q"] = query
        return value

    real = tw.dispatch_attention_fn
    tw.dispatch_attention_fn = capture
    try:
        with torch.no_grad():
            attn(x_flat, None, None, (freqs_cos, freqs_sin))
    finally:
        tw.dispatch_attention_fn = real
    return seen["q"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rounding_2_is_bit_exact_with_wans_eager_order(dtype):
    """diffusers' WanAttention (torch.nn.RMSNorm over the flat row, unflatten, rotation in fp32)
    gives the reference's bits with rounding 2 and norm_scope 1; modes 0 and 1 differ from it on
    these inputs in bf16/fp16 (the check tells the modes apart)."""
    pytest.importorskip("diffusers")
    heads, head_dim = 4, 48
    q, _, qw, _, cache = _inputs(dtype, heads=heads, head_dim=head_dim, seq=11, seed=3)
    want = _wan_eager(q.flatten(2), qw, cache[:11], heads, 1e-6, dtype)
    modes = {m: qk_norm_rope_reference(q, q, qw, qw, cache, eps=1e-6, rounding=m,
                                       norm_scope=ROW)[0] for m in contract.ROUNDING_MODES}
    assert torch.equal(modes[contract.ROUNDING_TWO_STEPS], want)
    if dtype != torch.float32:
        for m in (contract.ROUNDING_ONE, contract.ROUNDING_EACH_STEP):
            assert not torch.equal(modes[m], want), m


# The bound against float64 (docs/spec.md section 3.2): per output element,
# |out - out64| <= (m u_t + (n + 13) / 2 * u) * r, with n = H * D, u = 2^-24 (fp32 unit
# roundoff), u_t the activation dtype's unit roundoff (2^-8 bf16, 2^-11 fp16, 0 fp32), m the
# roundings to that dtype on the way (rounding 0: 1, at the end; 1: 3, x*inv, *w and the end;
# 2: 2, x*inv*w and the end) and r the length of the element's rotated pair in the float64
# result.
U = 2.0 ** -24
U_T = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 0.0}
ROUNDINGS = {contract.ROUNDING_ONE: 1, contract.ROUNDING_EACH_STEP: 3, contract.ROUNDING_TWO_STEPS: 2}


def _float64_row_reference(x, w, cache, eps):
    xd = x.double()
    h, d = x.shape[-2:]
    inv = 1 / torch.sqrt(xd.flatten(-2).pow(2).mean(-1) + eps)[..., None, None]
    y = xd * inv * w.double().reshape(h, d)
    s, half = x.shape[1], cache.shape[1] // 2
    c, n = cache[:s, :half].double()[None, :, None], cache[:s, half:].double()[None, :, None]
    a, b = y[..., 0::2], y[..., 1::2]
    out = torch.stack((a * c - b * n, a * n + b * c), -1).flatten(-2)
    r = torch.sqrt(a * a + b * b).repeat_interleave(2, -1)
    return out, r


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("heads,head_dim", [(5, 64), (40, 128)])
def test_bound_against_float64(dtype, heads, head_dim):
    """Every mode stays within the spec's bound; (40, 128) is Wan 14B's row of 5120."""
    q, k, qw, kw, cache = _inputs(dtype, heads=heads, head_dim=head_dim, seq=5, seed=7)
    n = heads * head_dim
    for mode in contract.ROUNDING_MODES:
        outs = qk_norm_rope_reference(q, k, qw, kw, cache, eps=1e-6, rounding=mode,
                                      norm_scope=ROW)
        for x, w, o in ((q, qw, outs[0]), (k, kw, outs[1])):
            want, r = _float64_row_reference(x, w, cache, 1e-6)
            bound = (ROUNDINGS[mode] * U_T[dtype] + (n + 13) / 2 * U) * r
            err = (o.double() - want).abs()
            assert (err <= bound).all(), (mode, (err / bound).max().item())


# --------------------------------------------------------------------------------------------
# The ONNX node and its function body
# --------------------------------------------------------------------------------------------

class _OpOnly(torch.nn.Module):
    def __init__(self, rounding, norm_scope, interleaved=True):
        super().__init__()
        self.rounding, self.norm_scope, self.interleaved = rounding, norm_scope, interleaved

    def forward(self, q, k, q_weight, k_weight, cos_sin_cache):
        return qk_norm_rope(q, k, q_weight, k_weight, cos_sin_cache, eps=1e-6,
                            interleaved=self.interleaved, rounding=self.rounding,
                            norm_scope=self.norm_scope)


def _export(tmp_path, module, args, head_dim, rotary_dim):
    """The op alone, batch and token axes dynamic (the cache's rows as traced)."""
    import onnx_ir as ir

    batch, seq = torch.export.Dim("batch"), torch.export.Dim("seq", max=args[4].shape[0])
    tokens = {0: batch, 1: seq}
    with torch.no_grad():
        program = torch.onnx.export(
            module, args, dynamo=True, input_names=list(contract.INPUTS),
            output_names=list(contract.OUTPUTS), verbose=False,
            dynamic_shapes=(tokens, tokens, None, None, None),
            custom_translation_table={
                torch.ops.qkrope.qk_norm_rope.default: qk_norm_rope_translation})
    model = finalize_model(program.model, opset=18, head_dim=head_dim, rotary_dim=rotary_dim,
                           expected_nodes=1)
    path = tmp_path / "op.onnx"
    ir.save(model, path)
    onnx.checker.check_model(str(path), full_check=True)
    return path


def _run(path, args):
    import onnxruntime as ort

    from qkrope.runtime.inputs import from_ort_value, from_torch, to_ort_value, to_torch

    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {n: to_ort_value(from_torch(t)) for n, t in zip(contract.INPUTS, args)}
    return [to_torch(from_ort_value(o)) for o in sess.run_with_ort_values(None, feeds)]


def test_head_scope_node_and_body_are_unchanged(tmp_path):
    """A head-scope export writes no norm_scope: not on the node, not in the body's attributes,
    and the body has no row constant (graphs written before the attribute stay identical)."""
    args = _inputs(torch.float32, heads=2, head_dim=16)
    args = args[:2] + (args[2][:16], args[3][:16], args[4])
    path = _export(tmp_path, _OpOnly(0, 0), args, 16, 16)
    model = onnx.load(str(path))
    node = next(n for n in model.graph.node if n.op_type == contract.OP_TYPE)
    assert "norm_scope" not in {a.name for a in node.attribute}
    fn = next(f for f in model.functions if f.name == contract.OP_TYPE)
    assert "norm_scope" not in {a.name for a in fn.attribute_proto}
    assert not any("axes_row" in n.output for n in fn.node)
    assert make_function_proto(FunctionVariant()) == make_function_proto(
        FunctionVariant.from_tag("interleaved-rounding0"))


@pytest.mark.parametrize("tag", ["interleaved-rounding2-row", "neox-rounding1-partial-row",
                                 "interleaved-rounding0-partial-row"])
def test_variant_tags_round_trip(tag):
    v = FunctionVariant.from_tag(tag)
    assert v.norm_scope == ROW and v.tag == tag
    with pytest.raises(InputError, match="not a QKNormRoPE function-body tag"):
        FunctionVariant.from_tag("interleaved-rounding2-row-partial")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rounding,interleaved,rotary_dim", [
    (2, True, 64), (0, True, 48), (1, False, 64)])
def test_row_body_in_onnx_runtime(tmp_path, dtype, rounding, interleaved, rotary_dim):
    """The row-scope body run by ONNX Runtime against the reference, at a token count and a
    batch other than the traced ones. ORT's ReduceMean sums the n = H*D squares in another
    order than torch: fp32 outputs then differ by at most (n + 13) / 2 fp32 unit roundoffs of
    the row's largest pair (the bound of test_bound_against_float64, both sides within it of
    float64: twice that); bf16/fp16 outputs by at most two steps (one rounding of y flipped,
    then the final one), on few elements."""
    heads, head_dim = 5, 64
    q, k, qw, kw, cache = _inputs(dtype, heads=heads, head_dim=head_dim, seq=7,
                                  rotary_dim=rotary_dim, seed=1)
    path = _export(tmp_path, _OpOnly(rounding, ROW, interleaved), (q, k, qw, kw, cache),
                   head_dim, rotary_dim)
    model = onnx.load(str(path))
    node = next(n for n in model.graph.node if n.op_type == contract.OP_TYPE)
    assert {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}["norm_scope"] == 1
    assert function_variant(model) == FunctionVariant(interleaved, rounding,
                                                      rotary_dim < head_dim, ROW)
    assert contract.validate_qknorm_rope_nodes(model, where="op.onnx") == 1
    # untraced shapes: batch 3, 5 tokens (the cache keeps its 9 rows)
    q2, k2, _, _, _ = _inputs(dtype, heads=heads, head_dim=head_dim, seq=5, batch=3, seed=2)
    got = _run(path, (q2, k2, qw, kw, cache))
    ref = qk_norm_rope_reference(q2, k2, qw, kw, cache, eps=1e-6, interleaved=interleaved,
                                 rounding=rounding, norm_scope=ROW)
    n = heads * head_dim
    for g_out, r in zip(got, ref):
        assert g_out.dtype == dtype and g_out.shape == r.shape
        g_f, r_f = g_out.float(), r.float()
        scale = r_f.abs().max().item()
        if dtype == torch.float32:
            tol = 2 * (n + 13) / 2 * U * math.sqrt(2) * scale
        else:
            step = 2.0 ** (math.floor(math.log2(scale)) - (7 if dtype == torch.bfloat16 else 10))
            tol = 2 * step
        assert (g_f - r_f).abs().max().item() <= tol
        if dtype != torch.float32:
            assert (g_f != r_f).float().mean().item() < 0.05


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_row_body_bit_exact_where_the_sum_of_squares_is_exact(tmp_path, dtype):
    """Grid inputs (x = m/16: every square and partial sum exact in fp32, whatever the order):
    the body's rounding-2 row bits equal the reference's, hence Wan's eager order's."""
    heads, head_dim = 4, 32
    g = torch.Generator().manual_seed(4)
    shape = (2, 6, heads, head_dim)
    q = (torch.randint(-127, 128, shape, generator=g).float() / 16).to(dtype)
    k = (torch.randint(-127, 128, shape, generator=g).float() / 4).to(dtype)
    qw = (torch.rand(heads * head_dim, generator=g) + 0.5).to(dtype)
    kw = (torch.rand(heads * head_dim, generator=g) * 2 - 1).to(dtype)
    angles = torch.randn(8, head_dim // 2, generator=g) * 3
    cache = torch.cat([angles.cos(), angles.sin()], -1)
    path = _export(tmp_path, _OpOnly(2, ROW), (q, k, qw, kw, cache), head_dim, head_dim)
    got = _run(path, (q, k, qw, kw, cache))
    ref = qk_norm_rope_reference(q, k, qw, kw, cache, eps=1e-6, rounding=2, norm_scope=ROW)
    for g_out, r in zip(got, ref):
        assert torch.equal(g_out, r)
