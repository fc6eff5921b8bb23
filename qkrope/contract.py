"""The QKNormRoPE node contract: the one place that names the node, its inputs, outputs and
attributes, and states each default once (docs/spec.md section 4). The exporter writes from it,
every signature with an ``eps``/``interleaved``/``rounding`` parameter takes its default from
here, the values one node carries travel together as :class:`NodeAttributes`, the tests
check against it, and the TensorRT plugin's field list is compared with it by
tests/test_plugin_host.py.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from qkrope.errors import InputError, QkropeError

DOMAIN = "qkrope"
DOMAIN_VERSION = 1
# Version of the node contract (inputs, attributes, cache format; docs/spec.md section 4) that an
# exported model's QKNormRoPE nodes follow; recorded in the ONNX file's metadata_props.
CONTRACT_VERSION = "1"
OP_TYPE = "QKNormRoPE"
# The torch custom op that stands for the node before export: torch.ops.qkrope.qk_norm_rope
TORCH_OP = "qkrope::qk_norm_rope"

INPUTS = ("q", "k", "q_weight", "k_weight", "cos_sin_cache")
OUTPUTS = ("q_out", "k_out")

PLUGIN_NAME = OP_TYPE
PLUGIN_VERSION = "1"
PLUGIN_NAMESPACE = DOMAIN

# The op's defaults (docs/spec.md section 4), each stated once.
DEFAULT_EPS = 1e-6
DEFAULT_INTERLEAVED = True
# The rounding attribute's values (docs/spec.md sections 3 and 4): where a bf16/fp16 result is
# rounded to the activation dtype.
# Each mode is named by where it rounds, never by a model that uses it (the family records say
# which mode their eager order is):
#   ROUNDING_ONE       (0) once, at the end (normalise, scale and rotate in fp32).
#   ROUNDING_EACH_STEP (1) after each of the three steps: the normalised value rounded, times the
#                          weight rounded, then rotated (complex) and rounded.
#   ROUNDING_TWO_STEPS (2) twice: the normalised value times the weight rounded once (torch's
#                          fused RMSNorm), then rotated in fp32 and rounded again.
ROUNDING_ONE = 0
ROUNDING_EACH_STEP = 1
ROUNDING_TWO_STEPS = 2
ROUNDING_MODES = (ROUNDING_ONE, ROUNDING_EACH_STEP, ROUNDING_TWO_STEPS)
ROUNDING_MEANINGS = {
    ROUNDING_ONE: "one rounding",
    ROUNDING_EACH_STEP: "rounded after each step (normalise, weight, rotate)",
    ROUNDING_TWO_STEPS: "rounded twice (normalise times weight, rotate)",
}
DEFAULT_ROUNDING = ROUNDING_ONE
# The norm_scope attribute's values (docs/spec.md section 3.2): what one RMSNorm spans.
#   NORM_SCOPE_HEAD (0) each head's D values, weight [D] (Qwen-Image, FLUX, ...).
#   NORM_SCOPE_ROW  (1) all H*D values of a token (the flat row before the head split), weight
#                       [H*D] indexed h*D + d (Wan's torch.nn.RMSNorm(heads * head_dim)); then
#                       the unflatten to heads and the per-head RoPE exactly as for 0.
# Omitted from a node (and its records) at 0, so graphs written before it stay identical.
NORM_SCOPE_HEAD = 0
NORM_SCOPE_ROW = 1
NORM_SCOPES = (NORM_SCOPE_HEAD, NORM_SCOPE_ROW)
NORM_SCOPE_MEANINGS = {
    NORM_SCOPE_HEAD: "per head, weight [head_dim]",
    NORM_SCOPE_ROW: "over the token's flat row of heads * head_dim values, weight "
                    "[heads * head_dim]",
}
DEFAULT_NORM_SCOPE = NORM_SCOPE_HEAD

# The attention around the node (docs/spec.md section 4; `qkrope export --attention`; built in
# export/attention.py): "primitive" = MatMul, mask bias, Softmax, MatMul, any opset the exporter
# writes; "onnx23" = one opset-23 ONNX Attention node, which needs that opset.
ATTENTION_FORMS = ("primitive", "onnx23")
DEFAULT_ATTENTION_FORM = ATTENTION_FORMS[0]
ATTENTION_MIN_OPSET = {"onnx23": 23}
# The opsets qkrope exports (`qkrope export --opset`): the dynamo exporter targets 18 and later;
# the function body (export/onnx_function.py) is written for 18..23; 18 has the widest TensorRT
# and ONNX Runtime support.
DEFAULT_OPSET = 18
MIN_OPSET = 18
MAX_OPSET = 23


@dataclass(frozen=True)
class Attribute:
    name: str
    onnx_type: str  # "FLOAT" | "INT" | "STRING" (onnx.AttributeProto type names)
    default: float | int | str
    plugin_field: str | None  # TensorRT PluginFieldType the parser forwards, None if not a field
    # Left off a node (and NodeAttributes.to_node) at its default: graphs and records written
    # before the attribute existed stay identical, and a node without it reads as the default.
    omitted_at_default: bool = False


ATTRIBUTES = (
    Attribute("epsilon", "FLOAT", DEFAULT_EPS, "kFLOAT32"),
    Attribute("interleaved", "INT", int(DEFAULT_INTERLEAVED), "kINT32"),
    Attribute("rounding", "INT", DEFAULT_ROUNDING, "kINT32"),
    Attribute("norm_scope", "INT", DEFAULT_NORM_SCOPE, "kINT32", omitted_at_default=True),
    # Read by the ONNX parser to find the plugin in the registry; not plugin fields.
    Attribute("plugin_version", "STRING", PLUGIN_VERSION, None),
    Attribute("plugin_namespace", "STRING", PLUGIN_NAMESPACE, None),
)

ATTRIBUTE_BY_NAME = {a.name: a for a in ATTRIBUTES}
# The fields the plugin creator must list, in order, with their TensorRT types.
PLUGIN_FIELDS = tuple((a.name, a.plugin_field) for a in ATTRIBUTES if a.plugin_field is not None)

# Activation dtypes the op supports (the cache is always float32).
ACTIVATION_DTYPES = ("float32", "float16", "bfloat16")

# head_dim: even and in [MIN_HEAD_DIM, MAX_HEAD_DIM], the kernel's rule (kMAX_HEAD_DIM in
# plugins/kernel/qknorm_rope.h, checked by checkParams in plugins/kernel/qknorm_rope_check.cpp).
MIN_HEAD_DIM = 2
MAX_HEAD_DIM = 512

# --------------------------------------------------------------------------------------------
# The value rules, each stated once. The C ABI (checkParams, plugins/kernel/qknorm_rope_check.cpp)
# and the plugin's field table (kFIELDS, plugins/plugin/qknorm_rope_fields.h) mirror them.
# --------------------------------------------------------------------------------------------

EPSILON_RULE = "a finite float with 0 < eps < 1 in float32"


def epsilon_error(eps: Any) -> str | None:
    """None when ``eps`` is a valid epsilon, else why not. The one rule: a real number (not a
    bool or a string) that is finite and, once narrowed to float32 (how the node, the plugin and
    the kernel hold it), strictly between 0 and 1. So 1e-50, which float32 stores as 0.0, and
    0.99999999, which it stores as 1.0, are refused."""
    import numpy as np

    if isinstance(eps, (bool, np.bool_)) or not isinstance(eps, (int, float, np.floating,
                                                                  np.integer)):
        return f"got a {type(eps).__name__} {eps!r}"
    value = float(eps)
    if not math.isfinite(value):
        return f"got {eps!r}"
    with np.errstate(over="ignore", under="ignore"):
        narrowed = float(np.float32(value))
    if not (math.isfinite(narrowed) and 0.0 < narrowed < 1.0):
        return f"got {eps!r}, which float32 stores as {narrowed!r}"
    return None


def check_epsilon(eps: Any, *, what: str = "eps") -> float:
    """``float(eps)`` when it obeys :func:`epsilon_error`'s rule, else an InputError."""
    why = epsilon_error(eps)
    if why is not None:
        raise InputError(f"{what} must be {EPSILON_RULE} (Qwen-Image uses {DEFAULT_EPS:g}); {why}")
    return float(eps)


def head_dim_error(head_dim: Any) -> str | None:
    if isinstance(head_dim, bool) or not isinstance(head_dim, int):
        try:
            import numpy as np

            if isinstance(head_dim, np.integer):
                head_dim = int(head_dim)
            else:
                return f"got a {type(head_dim).__name__} {head_dim!r}"
        except ImportError:  # pragma: no cover
            return f"got a {type(head_dim).__name__} {head_dim!r}"
    if head_dim % 2 or not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        return f"got {head_dim}"
    return None


def check_head_dim(head_dim: Any, *, what: str = "head_dim") -> int:
    """The kernel's head_dim rule: even and in [2, 512]."""
    why = head_dim_error(head_dim)
    if why is not None:
        raise InputError(f"{what} must be even and in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}] (the "
                         f"kernel's limit); {why}")
    return int(head_dim)


def _is_01(value: Any) -> bool:
    import numpy as np

    if isinstance(value, (bool, np.bool_)):
        return True
    return isinstance(value, (int, np.integer)) and int(value) in (0, 1)


def check_interleaved(value: Any, *, what: str = "interleaved") -> bool:
    """True/False (or 0/1); anything else ("no", 2, None) is an error, never truthiness."""
    if not _is_01(value):
        raise InputError(f"{what} must be True/False (or 1/0): True pairs (2j, 2j+1) as in "
                         f"Qwen-Image, False NeoX halves; got a {type(value).__name__} {value!r}")
    return bool(value)


ROUNDING_RULE = ", ".join(f"{m} ({ROUNDING_MEANINGS[m]})" for m in ROUNDING_MODES[:-1]) + \
    f" or {ROUNDING_MODES[-1]} ({ROUNDING_MEANINGS[ROUNDING_MODES[-1]]})"


def check_rounding(value: Any, *, what: str = "rounding") -> int:
    """One of :data:`ROUNDING_MODES` as an int (numpy integers accepted); a bool, a float or any
    other value is an InputError."""
    import numpy as np

    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) \
            or int(value) not in ROUNDING_MODES:
        raise InputError(f"{what} must be {ROUNDING_RULE}; got {value!r}")
    return int(value)


NORM_SCOPE_RULE = " or ".join(f"{m} ({NORM_SCOPE_MEANINGS[m]})" for m in NORM_SCOPES)


def check_norm_scope(value: Any, *, what: str = "norm_scope") -> int:
    """One of :data:`NORM_SCOPES` as an int (numpy integers accepted); a bool, a float or any
    other value is an InputError."""
    import numpy as np

    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) \
            or int(value) not in NORM_SCOPES:
        raise InputError(f"{what} must be {NORM_SCOPE_RULE}; got {value!r}")
    return int(value)


@dataclass(frozen=True)
class NodeAttributes:
    """The values one QKNormRoPE node is written with (``eps``, ``interleaved``, ``rounding``,
    ``norm_scope``), carried as one value from the user's keywords to the node, the reference
    and the kernel
    calls, and stored once per export (the sidecar's ``node_attributes``). Checked on creation
    by the contract's rules (an :class:`~qkrope.errors.InputError` naming the value) and held
    as float / bool / int."""

    eps: float = DEFAULT_EPS
    interleaved: bool = DEFAULT_INTERLEAVED
    rounding: int = DEFAULT_ROUNDING
    norm_scope: int = DEFAULT_NORM_SCOPE

    def __post_init__(self) -> None:
        object.__setattr__(self, "eps", check_epsilon(self.eps))
        object.__setattr__(self, "interleaved", check_interleaved(self.interleaved))
        object.__setattr__(self, "rounding", check_rounding(self.rounding))
        object.__setattr__(self, "norm_scope", check_norm_scope(self.norm_scope))

    def to_node(self) -> dict[str, float | int | str]:
        """The node's attribute values (:data:`ATTRIBUTES`' names and ONNX types), without
        ``norm_scope`` when it is the default (:attr:`Attribute.omitted_at_default`)."""
        out = {
            "epsilon": float(self.eps),
            "interleaved": int(self.interleaved),
            "rounding": int(self.rounding),
            "norm_scope": int(self.norm_scope),
            "plugin_version": PLUGIN_VERSION,
            "plugin_namespace": PLUGIN_NAMESPACE,
        }
        return {k: v for k, v in out.items()
                if not (ATTRIBUTE_BY_NAME[k].omitted_at_default
                        and v == ATTRIBUTE_BY_NAME[k].default)}

    @classmethod
    def from_node(cls, attrs: Any) -> "NodeAttributes":
        """From a node's attribute values (:meth:`to_node`'s form); absent ones take the
        contract's defaults."""
        return cls(eps=attrs.get("epsilon", DEFAULT_EPS),
                   interleaved=attrs.get("interleaved", int(DEFAULT_INTERLEAVED)),
                   rounding=attrs.get("rounding", DEFAULT_ROUNDING),
                   norm_scope=attrs.get("norm_scope", DEFAULT_NORM_SCOPE))

    def as_kwargs(self) -> dict[str, float | bool | int]:
        """``eps=, interleaved=, rounding=`` (and ``norm_scope=`` when it is not the default,
        as on the node): the keywords of the public functions."""
        out: dict[str, float | bool | int] = {"eps": self.eps, "interleaved": self.interleaved,
                                              "rounding": self.rounding}
        if self.norm_scope != DEFAULT_NORM_SCOPE:
            out["norm_scope"] = self.norm_scope
        return out


def node_attributes(*, eps: float = DEFAULT_EPS, interleaved: bool = DEFAULT_INTERLEAVED,
                    rounding: int = DEFAULT_ROUNDING,
                    norm_scope: int = DEFAULT_NORM_SCOPE) -> dict[str, float | int | str]:
    """The attribute values written on one node, validated (``norm_scope`` left off at 0)."""
    check_epsilon(eps, what="epsilon")
    return NodeAttributes(eps, interleaved, rounding, norm_scope).to_node()


def attribute_names_error(names: Any) -> str | None:
    """None when a node's attribute ``names`` are the contract's (those omitted at their
    default may be absent), else what is wrong."""
    names = set(names)
    unknown = sorted(names - set(ATTRIBUTE_BY_NAME))
    if unknown:
        return f"has unknown attribute {unknown[0]!r}; the contract lists " \
               f"{[a.name for a in ATTRIBUTES]}"
    missing = [a.name for a in ATTRIBUTES if a.name not in names and not a.omitted_at_default]
    if missing:
        return f"has no attribute {missing[0]!r}; the contract lists " \
               f"{[a.name for a in ATTRIBUTES]}"
    return None


# --------------------------------------------------------------------------------------------
# The one validator of QKNormRoPE nodes in an ONNX model (every consumer runs it first)
# --------------------------------------------------------------------------------------------

class NodeContractError(QkropeError, ValueError):
    """A QKNormRoPE node of an ONNX model breaks the node contract (docs/spec.md section 4); the
    message names the model, the node and the attribute."""


_VALID_VALUES = {
    "interleaved": ((0, 1), "0 or 1 (1: interleaved pairs (2j, 2j+1), 0: NeoX halves)"),
    "rounding": (ROUNDING_MODES, ROUNDING_RULE),
    "norm_scope": (NORM_SCOPES, NORM_SCOPE_RULE),
    "plugin_version": ((PLUGIN_VERSION,), f"{PLUGIN_VERSION!r}"),
    "plugin_namespace": ((PLUGIN_NAMESPACE,), f"{PLUGIN_NAMESPACE!r}"),
}


def _subgraphs(node):
    import onnx

    for a in node.attribute:
        if a.type == onnx.AttributeProto.GRAPH:
            yield a.g
        elif a.type == onnx.AttributeProto.GRAPHS:
            yield from a.graphs


def _all_nodes(graph):
    for node in graph.node:
        yield node
        for sub in _subgraphs(node):
            yield from _all_nodes(sub)


def validate_qknorm_rope_nodes(model: Any, *, where: str) -> int:
    """Check every ``QKNormRoPE`` node of an ONNX model against the node contract; returns how
    many there are (0 is allowed: a model without the op).

    ``model`` is an ``onnx.ModelProto`` or the path of an ONNX file (read without its external
    data); ``where`` names it in messages (usually the path). Checked per node, in the main graph,
    its subgraphs and the model-local functions: domain ``qkrope`` (and the model imports it at
    version 1), 5 inputs and 2 outputs, no unknown attribute, and each contract attribute present
    with its ONNX type and a valid value (``epsilon`` FLOAT by :func:`epsilon_error`'s rule,
    ``interleaved`` INT 0 or 1, ``rounding`` INT one of :data:`ROUNDING_MODES`, ``norm_scope`` INT
    one of :data:`NORM_SCOPES` where present (absent: 0),
    ``plugin_version`` STRING "1", ``plugin_namespace`` STRING "qkrope"). Raises :class:`NodeContractError` naming the node and the attribute."""
    import onnx

    fix = "Fix: re-export the model with `qkrope export`"
    if isinstance(model, (str, os.PathLike)):
        try:
            model = onnx.load(str(model), load_external_data=False)
        except Exception as exc:  # noqa: BLE001 - any parse failure: not an ONNX file
            raise NodeContractError(f"{where}: cannot be read as an ONNX model "
                                    f"({type(exc).__name__}: {exc}). {fix}") from None
    type_ids = {"FLOAT": onnx.AttributeProto.FLOAT, "INT": onnx.AttributeProto.INT,
                "STRING": onnx.AttributeProto.STRING}
    type_names = {v: k for k, v in onnx.AttributeProto.AttributeType.items()}
    graphs = [("graph", n) for n in _all_nodes(model.graph)]
    for fn in model.functions:
        if (fn.domain, fn.name) == (DOMAIN, OP_TYPE):
            continue  # the op's own body: standard ops
        graphs += [(f"function {fn.domain}::{fn.name}", n) for n in fn.node]
    count = 0
    for i, (scope, node) in enumerate(graphs):
        if node.op_type != OP_TYPE:
            continue
        count += 1
        label = f"{where}: {OP_TYPE} node {node.name or '#' + str(i)!r} ({scope})"

        def fail(what: str) -> None:
            raise NodeContractError(f"{label}: {what}. {fix}")

        if node.domain != DOMAIN:
            fail(f"has domain {node.domain!r}, the contract's is {DOMAIN!r}")
        if len(node.input) != len(INPUTS) or any(not n for n in node.input):
            fail(f"has inputs {list(node.input)}, expected {len(INPUTS)} named inputs "
                 f"{list(INPUTS)}")
        if len(node.output) != len(OUTPUTS) or any(not n for n in node.output):
            fail(f"has outputs {list(node.output)}, expected {len(OUTPUTS)} {list(OUTPUTS)}")
        attrs = {a.name: a for a in node.attribute}
        unknown = sorted(set(attrs) - set(ATTRIBUTE_BY_NAME))
        if unknown:
            fail(f"has unknown attribute {unknown[0]!r}; the contract lists "
                 f"{[a.name for a in ATTRIBUTES]}")
        for spec in ATTRIBUTES:
            a = attrs.get(spec.name)
            if a is None and spec.omitted_at_default:
                continue  # absent: the default (graphs written before the attribute)
            if a is None:
                fail(f"has no attribute {spec.name!r} ({spec.onnx_type}, "
                     f"{spec.default!r} by default)")
            if a.type != type_ids[spec.onnx_type]:
                fail(f"attribute {spec.name!r} has type {type_names.get(a.type, a.type)}, "
                     f"expected {spec.onnx_type}")
            if spec.onnx_type == "FLOAT":
                why = epsilon_error(float(a.f))
                if why is not None:
                    fail(f"attribute {spec.name!r} = {a.f!r} is invalid: expected {EPSILON_RULE}")
                continue
            value = int(a.i) if spec.onnx_type == "INT" else a.s.decode("utf-8", "replace")
            allowed, text = _VALID_VALUES[spec.name]
            if value not in allowed:
                fail(f"attribute {spec.name!r} = {value!r} is invalid: expected {text}")
    if count:
        imports = {o.domain: o.version for o in model.opset_import}
        if imports.get(DOMAIN) != DOMAIN_VERSION:
            raise NodeContractError(
                f"{where}: has {count} {OP_TYPE} node(s) but imports domain {DOMAIN!r} at "
                f"version {imports.get(DOMAIN)!r}, expected {DOMAIN_VERSION}. {fix}")
    return count
