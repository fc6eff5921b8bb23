"""ONNX side of QKNormRoPE: the torch.onnx translation and the model-local function body.

Two things live here (docs/spec.md section 4):

1. :func:`qk_norm_rope_translation`, the entry of ``custom_translation_table`` for
   ``torch.ops.qkrope.qk_norm_rope``. The dynamo exporter traces it with onnxscript and it writes
   exactly one ``qkrope::QKNormRoPE`` node per call, with the attributes from
   :func:`qkrope.export.contract.node_attributes` (so the node contract has one source).

2. :func:`make_function_proto`, the model-local ONNX function ``qkrope::QKNormRoPE`` whose body
   implements docs/spec.md section 3 with standard ONNX ops, so ONNX Runtime (any execution
   provider), ``onnx.reference`` and TensorRT without the plugin can run the same file.

Opset. The default is **18**: it is the opset torch's dynamo exporter (torchlib) emits natively
(lower opsets go through onnx's version converter, which is lossy and slow on big graphs); ONNX
Runtime supports it since 1.14 and TensorRT's ONNX parser since 8.6 (TensorRT 10.x parses opsets
9-22). The body uses only ops whose opset-18 signatures are unchanged up to opset 23 (Cast,
CastLike, Mul, Add, Sub, Sqrt, Reciprocal, ReduceMean with ``axes`` as an input, Shape, Slice,
Split, Reshape, Concat, Unsqueeze, Constant), so the same body is valid for ``--opset`` 18..23.
Opset 17 or lower is refused (ReduceMean/Split/Unsqueeze signatures differ and the exporter does
not target them).

Function body strategy. ``epsilon`` is an *attribute reference* inside the body
(``Constant(value_float=@epsilon)``), so the body follows each node's value exactly. The other
two attributes change the *structure* of the computation (``interleaved``: which elements form a
pair; ``rounding``: extra casts to the activation dtype), and ONNX functions cannot branch on an
attribute without a runtime ``If`` or computing both variants and selecting (both of which would
make the TensorRT no-plugin fallback and ONNX Runtime slower, and ``If`` with subgraphs inside a
function is poorly supported by TensorRT's parser). ONNX allows one function per (domain, name)
without overloads, and TensorRT's parser looks functions up by name only, so the exporter emits
one body per model, specialised for the (interleaved, rounding, partial-rotary, norm_scope)
combination all of
the model's QKNormRoPE nodes share; :func:`qkrope.export.onnx_export` refuses a model whose nodes
disagree, records the variant in the model's metadata (``qkrope.function_body``), and
:func:`function_variant` reads that record back.
The body is generic in the activation dtype (``CastLike`` to the input), in the number of rows,
tokens, heads, and in ``rotary_dim`` (read from the cache's shape); only whether
``rotary_dim < head_dim`` (a pass-through tail exists) is structural. The function still declares
all five attributes with their defaults so a node may carry them (onnx.checker and ONNX Runtime
accept them; TensorRT's parser ignores unreferenced ones).
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx
from onnx import TensorProto, helper
from onnxscript.values import Op, Opset

from qkrope.errors import InputError
from qkrope import contract
from qkrope.contract import DEFAULT_OPSET, MAX_OPSET, MIN_OPSET  # noqa: F401 (this API)

QKNORMROPE = Opset(contract.DOMAIN, contract.DOMAIN_VERSION)


def _op_schema() -> onnx.defs.OpSchema:
    """An OpSchema for the node, built from the contract and *not* registered globally: onnxscript
    needs one to emit a call; the model itself carries the function body instead."""
    S = onnx.defs.OpSchema
    act = ("T", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"], "activations")
    weights = ("W", ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"],
               "norm weights: T, or float with any T")
    cache = ("C", ["tensor(float)"], "cos_sin_cache")
    types = {"q": "T", "k": "T", "q_weight": "W", "k_weight": "W", "cos_sin_cache": "C"}
    attr_types = {"FLOAT": S.AttrType.FLOAT, "INT": S.AttrType.INT, "STRING": S.AttrType.STRING}
    return S(
        contract.OP_TYPE, contract.DOMAIN, contract.DOMAIN_VERSION,
        "Fused per-head RMSNorm + RoPE (docs/spec.md section 3).",
        inputs=[S.FormalParameter(name, types[name]) for name in contract.INPUTS],
        outputs=[S.FormalParameter(name, "T") for name in contract.OUTPUTS],
        type_constraints=[act, weights, cache],
        attributes=[S.Attribute(a.name, attr_types[a.onnx_type], a.name, required=False)
                    for a in contract.ATTRIBUTES],
    )


_QKNORMROPE_OP = Op(QKNORMROPE, contract.OP_TYPE, _op_schema())


def qk_norm_rope_translation(q, k, q_weight, k_weight, cos_sin_cache,
                             eps: float = contract.DEFAULT_EPS,
                             interleaved: bool = contract.DEFAULT_INTERLEAVED,
                             rounding: int = contract.DEFAULT_ROUNDING,
                             norm_scope: int = contract.DEFAULT_NORM_SCOPE):
    """``torch.ops.qkrope.qk_norm_rope`` -> one ``qkrope::QKNormRoPE`` node (traced by torch.onnx).

    The attributes are written from :func:`contract.node_attributes` (``norm_scope`` left off
    at 0); the function body is added to the model afterwards (see the module docstring for
    why).
    """
    attrs = contract.node_attributes(eps=float(eps), interleaved=bool(interleaved),
                                     rounding=int(rounding), norm_scope=int(norm_scope))
    q_out, k_out = _QKNORMROPE_OP(q, k, q_weight, k_weight, cos_sin_cache, **attrs)
    return q_out, k_out


@dataclass(frozen=True)
class FunctionVariant:
    """The structural choices a function body is specialised for."""

    interleaved: bool = contract.DEFAULT_INTERLEAVED
    rounding: int = contract.DEFAULT_ROUNDING
    partial: bool = False  # rotary_dim < head_dim: a tail of dims is normalised, not rotated
    # NORM_SCOPE_ROW: one RMSNorm over the token's H * D values (the tag's "-row")
    norm_scope: int = contract.DEFAULT_NORM_SCOPE

    @property
    def tag(self) -> str:
        return (f"{'interleaved' if self.interleaved else 'neox'}-rounding{self.rounding}"
                f"{'-partial' if self.partial else ''}"
                f"{'-row' if self.norm_scope == contract.NORM_SCOPE_ROW else ''}")

    @classmethod
    def from_tag(cls, tag: str) -> "FunctionVariant":
        parts = tag.split("-")
        if (len(parts) not in (2, 3, 4) or parts[0] not in ("interleaved", "neox")
                or parts[1] not in [f"rounding{m}" for m in contract.ROUNDING_MODES]
                or parts[2:] not in ([], ["partial"], ["row"], ["partial", "row"])):
            raise InputError(f"{tag!r} is not a QKNormRoPE function-body tag (e.g. "
                             f"'interleaved-rounding0', 'neox-rounding1-partial', "
                             f"'interleaved-rounding2', 'interleaved-rounding2-row')")
        return cls(parts[0] == "interleaved", int(parts[1][-1]), "partial" in parts[2:],
                   contract.NORM_SCOPE_ROW if "row" in parts[2:] else contract.NORM_SCOPE_HEAD)

    @classmethod
    def of_node(cls, attrs, *, partial: bool) -> "FunctionVariant":
        """The variant a node with these attribute values (name -> value; ``norm_scope``
        absent: 0) needs, for a model whose ``rotary_dim < head_dim`` is ``partial``."""
        return cls(bool(attrs["interleaved"]), int(attrs["rounding"]), bool(partial),
                   int(attrs.get("norm_scope", contract.DEFAULT_NORM_SCOPE)))


def _const_ints(name: str, values: list[int]) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=helper.make_tensor(
        name + "_value", TensorProto.INT64, [len(values)], values))


def _stream_nodes(p: str, x: str, w: str, out: str, v: FunctionVariant) -> list[onnx.NodeProto]:
    """Nodes computing docs/spec.md section 3 for one of q/k. ``p`` prefixes every intermediate name."""
    n = helper.make_node
    row = v.norm_scope == contract.NORM_SCOPE_ROW
    nodes = [
        n("Cast", [x], [f"{p}xf"], to=TensorProto.FLOAT),
        n("Mul", [f"{p}xf", f"{p}xf"], [f"{p}sq"]),
        # the mean of squares over the head's D values, or (row scope) over the token's H * D
        # values: ReduceMean over the last two axes of [B, S, H, D], keeping [B, S, 1, 1]
        n("ReduceMean", [f"{p}sq", "axes_row" if row else "axes_last"], [f"{p}ms"], keepdims=1),
        n("Add", [f"{p}ms", "eps"], [f"{p}mse"]),
        n("Sqrt", [f"{p}mse"], [f"{p}rms"]),
        n("Reciprocal", [f"{p}rms"], [f"{p}inv"]),
        n("Mul", [f"{p}xf", f"{p}inv"], [f"{p}xn"]),
    ]
    if row:
        # the weight [H * D] (index h * D + d) as [H, D], broadcast over batch and tokens
        nodes += [n("Shape", [x], [f"{p}hd"], start=2),
                  n("Reshape", [w, f"{p}hd"], [f"{p}w_hd"])]
        w = f"{p}w_hd"
    if v.rounding == contract.ROUNDING_EACH_STEP:
        # diffusers' eager order: round x*inv to the activation dtype, multiply by the weight in
        # that dtype (rounded again), then rotate in fp32. Identity casts for fp32 activations.
        # The multiply runs in fp32 on values already rounded to the activation dtype, then is
        # rounded: a product of two 11-bit (fp16) or 8-bit (bf16) significands is exact in fp32,
        # so this equals a correctly rounded fp16/bf16 multiply bit for bit, and needs only Cast
        # kernels in the activation dtype (ONNX Runtime's CPU provider has no bf16 Mul). An fp32
        # weight (W = float) enters at its value: the fp32 product, rounded (docs/spec.md 3).
        nodes += [
            n("CastLike", [f"{p}xn", x], [f"{p}xn_r"]),
            n("Cast", [f"{p}xn_r"], [f"{p}xn_rf"], to=TensorProto.FLOAT),
            n("Cast", [w], [f"{p}wf"], to=TensorProto.FLOAT),
            n("Mul", [f"{p}xn_rf", f"{p}wf"], [f"{p}yw"]),
            n("CastLike", [f"{p}yw", x], [f"{p}yw_r"]),
            n("Cast", [f"{p}yw_r"], [f"{p}y"], to=TensorProto.FLOAT),
        ]
    elif v.rounding == contract.ROUNDING_TWO_STEPS:
        # FLUX's eager order (torch's RMSNorm): (x*inv)*w in fp32, rounded once to the
        # activation dtype, then rotated in fp32 (diffusers' apply_rotary_emb). Identity casts
        # for fp32 activations.
        nodes += [
            n("Cast", [w], [f"{p}wf"], to=TensorProto.FLOAT),
            n("Mul", [f"{p}xn", f"{p}wf"], [f"{p}yw"]),
            n("CastLike", [f"{p}yw", x], [f"{p}yw_r"]),
            n("Cast", [f"{p}yw_r"], [f"{p}y"], to=TensorProto.FLOAT),
        ]
    else:
        nodes += [
            n("Cast", [w], [f"{p}wf"], to=TensorProto.FLOAT),
            n("Mul", [f"{p}xn", f"{p}wf"], [f"{p}y"]),
        ]
    # cache rows for this stream's tokens: cache[:S] -> cos [1, S, 1, half], sin likewise
    nodes += [
        n("Shape", [x], [f"{p}seq"], start=1, end=2),
        n("Slice", ["cos_sin_cache", "zero1", f"{p}seq", "zero1"], [f"{p}rows"]),
        n("Slice", [f"{p}rows", "zero1", "half", "one1"], [f"{p}cos2"]),
        n("Slice", [f"{p}rows", "half", "rot", "one1"], [f"{p}sin2"]),
    ]
    y_rot = f"{p}y"
    if v.partial:
        nodes += [
            n("Slice", [f"{p}y", "zero1", "rot", "minus1"], [f"{p}yr"]),
            n("Slice", [f"{p}y", "rot", "int_max", "minus1"], [f"{p}ypass"]),
        ]
        y_rot = f"{p}yr"
    if v.interleaved:
        # [B, S, H, rd] -> [B, S, H, half, 2]; a = [..., 0], b = [..., 1]
        nodes += [
            n("Unsqueeze", [f"{p}cos2", "axes_0_2_4"], [f"{p}cos"]),
            n("Unsqueeze", [f"{p}sin2", "axes_0_2_4"], [f"{p}sin"]),
            n("Reshape", [y_rot, "shape_pairs"], [f"{p}pairs"]),
            n("Split", [f"{p}pairs"], [f"{p}a", f"{p}b"], axis=-1, num_outputs=2),
        ]
    else:
        nodes += [
            n("Unsqueeze", [f"{p}cos2", "axes_0_2"], [f"{p}cos"]),
            n("Unsqueeze", [f"{p}sin2", "axes_0_2"], [f"{p}sin"]),
            n("Slice", [y_rot, "zero1", "half", "minus1"], [f"{p}a"]),
            n("Slice", [y_rot, "half", "rot", "minus1"], [f"{p}b"]),
        ]
    nodes += [
        n("Mul", [f"{p}a", f"{p}cos"], [f"{p}ac"]),
        n("Mul", [f"{p}b", f"{p}sin"], [f"{p}bs"]),
        n("Sub", [f"{p}ac", f"{p}bs"], [f"{p}ra"]),
        n("Mul", [f"{p}a", f"{p}sin"], [f"{p}as"]),
        n("Mul", [f"{p}b", f"{p}cos"], [f"{p}bc"]),
        n("Add", [f"{p}as", f"{p}bc"], [f"{p}rb"]),
        n("Concat", [f"{p}ra", f"{p}rb"], [f"{p}rot_out"], axis=-1),
    ]
    rot_out = f"{p}rot_out"
    if v.interleaved:
        nodes.append(n("Reshape", [rot_out, "shape_flat"], [f"{p}rot_flat"]))
        rot_out = f"{p}rot_flat"
    if v.partial:
        nodes.append(n("Concat", [rot_out, f"{p}ypass"], [f"{p}full"], axis=-1))
        rot_out = f"{p}full"
    nodes.append(n("CastLike", [rot_out, x], [out]))
    return nodes


#: the prefix of every function-body node name; ONNX Runtime reports a failing node by this name
BODY_NODE_PREFIX = f"{contract.OP_TYPE} body"


def _name_nodes(nodes: list[onnx.NodeProto], stream: str) -> None:
    """Name each body node after the QKNormRoPE input it serves and what it computes, e.g.
    ``QKNormRoPE body, q: Mul(q_ac) uses the cos_sin_cache rows of q's tokens``: a runtime
    reports a failing node by its name (an unnamed body node is ``''``), so an error on a cache
    with too few rows points at the cache input."""
    rows = {"cos_sin_cache"}  # values computed from the cache's rows (not only its shape)
    for i, node in enumerate(nodes):
        from_rows = node.op_type != "Shape" and any(v in rows for v in node.input)
        if from_rows:
            rows.update(node.output)
        uses = [v for v in node.input if v in contract.INPUTS and v != "cos_sin_cache"]
        what = (f" uses the cos_sin_cache rows of {stream}'s tokens" if from_rows
                else f" of {', '.join(uses)}" if uses
                else " of cos_sin_cache's shape" if "cos_sin_cache" in node.input else "")
        node.name = f"{BODY_NODE_PREFIX}, {stream}: {node.op_type}({node.output[0]}){what} #{i}"


def make_function_proto(variant: FunctionVariant = FunctionVariant(), *,
                        opset: int = DEFAULT_OPSET) -> onnx.FunctionProto:
    """The model-local function ``qkrope::QKNormRoPE`` (docs/spec.md section 3 in standard ops)."""
    if not MIN_OPSET <= opset <= MAX_OPSET:
        raise InputError(f"the QKNormRoPE function body is written for opsets {MIN_OPSET}.."
                         f"{MAX_OPSET}; got {opset}")
    n = helper.make_node
    common = [
        n("Constant", [], ["eps"], value_float=contract.DEFAULT_EPS),  # replaced by an attribute reference below
        _const_ints("axes_last", [-1]),
        _const_ints("zero1", [0]),
        _const_ints("one1", [1]),
        _const_ints("minus1", [-1]),
        _const_ints("two1", [2]),
        _const_ints("int_max", [2**62]),
        _const_ints("axes_0_2", [0, 2]),
        _const_ints("axes_0_2_4", [0, 2, 4]),
        _const_ints("shape_pairs", [0, 0, 0, -1, 2]),
        _const_ints("shape_flat", [0, 0, 0, -1]),
        n("Shape", ["cos_sin_cache"], ["rot"], start=1, end=2),
        n("Div", ["rot", "two1"], ["half"]),
    ]
    if variant.norm_scope == contract.NORM_SCOPE_ROW:  # only in a row-scope body
        common.append(_const_ints("axes_row", [-2, -1]))
    # epsilon follows the node: Constant(value_float=@epsilon)
    eps_attr = onnx.AttributeProto()
    eps_attr.name = "value_float"
    eps_attr.ref_attr_name = "epsilon"
    eps_attr.type = onnx.AttributeProto.FLOAT
    del common[0].attribute[:]
    common[0].attribute.append(eps_attr)

    q_in, k_in, qw_in, kw_in, _ = contract.INPUTS
    streams = ((q_in, _stream_nodes("q_", q_in, qw_in, contract.OUTPUTS[0], variant)),
               (k_in, _stream_nodes("k_", k_in, kw_in, contract.OUTPUTS[1], variant)))
    _name_nodes(common, "shared")
    for stream, stream_nodes in streams:
        _name_nodes(stream_nodes, stream)
    nodes = common + [node for _, stream_nodes in streams for node in stream_nodes]
    defaults = []
    for a in contract.ATTRIBUTES:
        if a.omitted_at_default and a.name == "norm_scope" \
                and variant.norm_scope == contract.DEFAULT_NORM_SCOPE:
            continue  # a head-scope body stays as it was before the attribute existed
        defaults.append(helper.make_attribute(a.name, a.default))
    fn = helper.make_function(
        contract.DOMAIN, contract.OP_TYPE, list(contract.INPUTS), list(contract.OUTPUTS), nodes,
        opset_imports=[helper.make_opsetid("", opset)], attributes=[],
        doc_string=f"QKNormRoPE ({variant.tag}); docs/spec.md section 3",
    )
    fn.attribute_proto.extend(defaults)
    return fn


FUNCTION_BODY_KEY = "qkrope.function_body"  # model metadata_props key the exporter writes


def function_variant(model: onnx.ModelProto) -> FunctionVariant:
    """The variant of the model's function body, as the exporter recorded it in the model's
    metadata (``qkrope.function_body``, :attr:`FunctionVariant.tag`)."""
    props = {p.key: p.value for p in model.metadata_props}
    if FUNCTION_BODY_KEY not in props:
        raise InputError(f"the model has no {FUNCTION_BODY_KEY!r} metadata: it was not written "
                         f"by `qkrope export`. Fix: re-export it")
    return FunctionVariant.from_tag(props[FUNCTION_BODY_KEY])
