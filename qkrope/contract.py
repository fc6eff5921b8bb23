"""The QKNormRoPE node contract: the one place that names the node, its inputs, outputs and
attributes, and states each default once (docs/spec.md section 4). The exporter writes from it,
every signature with an ``eps``/``interleaved``/``rounding`` parameter takes its default from
here, the tests check against it, and the TensorRT plugin's field list is compared with it by
tests/test_plugin_host.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from qkrope.errors import InputError

DOMAIN = "qkrope"
DOMAIN_VERSION = 1
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
DEFAULT_ROUNDING = 0


@dataclass(frozen=True)
class Attribute:
    name: str
    onnx_type: str  # "FLOAT" | "INT" | "STRING" (onnx.AttributeProto type names)
    default: float | int | str
    plugin_field: str | None  # TensorRT PluginFieldType the parser forwards, None if not a field


ATTRIBUTES = (
    Attribute("epsilon", "FLOAT", DEFAULT_EPS, "kFLOAT32"),
    Attribute("interleaved", "INT", int(DEFAULT_INTERLEAVED), "kINT32"),
    Attribute("rounding", "INT", DEFAULT_ROUNDING, "kINT32"),
    # Read by the ONNX parser to find the plugin in the registry; not plugin fields.
    Attribute("plugin_version", "STRING", PLUGIN_VERSION, None),
    Attribute("plugin_namespace", "STRING", PLUGIN_NAMESPACE, None),
)

ATTRIBUTE_BY_NAME = {a.name: a for a in ATTRIBUTES}
# The fields the plugin creator must list, in order, with their TensorRT types.
PLUGIN_FIELDS = tuple((a.name, a.plugin_field) for a in ATTRIBUTES if a.plugin_field is not None)

# Activation dtypes the op supports (the cache is always float32).
ACTIVATION_DTYPES = ("float32", "float16", "bfloat16")
MAX_HEAD_DIM = 512


def node_attributes(*, eps: float = DEFAULT_EPS, interleaved: bool = DEFAULT_INTERLEAVED,
                    rounding: int = DEFAULT_ROUNDING) -> dict[str, float | int | str]:
    """The attribute values written on one node, validated."""
    if not (eps > 0.0 and eps < 1.0):
        raise InputError(f"epsilon must be in (0, 1), got {eps!r}")
    if rounding not in (0, 1):
        raise InputError(f"rounding must be 0 or 1, got {rounding!r}")
    return {
        "epsilon": float(eps),
        "interleaved": int(bool(interleaved)),
        "rounding": int(rounding),
        "plugin_version": PLUGIN_VERSION,
        "plugin_namespace": PLUGIN_NAMESPACE,
    }
