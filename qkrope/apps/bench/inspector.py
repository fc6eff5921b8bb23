"""Whether a TensorRT engine runs the attention as one fused kernel, from its engine inspector's
layer information: the verdict with its basis (``fused_attention`` of the TensorRT rows), the
ONNX nodes that a fused attention must swallow, and the inspector asked on a loaded runner's
engine."""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import Any, Mapping, Sequence


_FUSED_KERNEL = re.compile(r"fmha|mha|flash|attention", re.IGNORECASE)
#: fused_attention values: a kernel named so; the span inside one Myelin region; separate
#: kernels; the information cannot tell
VERDICTS = ("yes", "likely", "no", "unknown")


def attention_span_nodes(onnx_path: Path) -> list[str]:
    """The names of the nodes a fused attention must swallow: every Softmax (primitive form)
    and every ``Attention`` node (onnx23) of the model's main graph."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    return [n.name for n in model.graph.node
            if n.name and n.domain in ("", "ai.onnx") and n.op_type in ("Softmax", "Attention")]


def fused_attention_from_inspector(info: str | Mapping[str, Any],
                                   span_nodes: Sequence[str] = ()) -> tuple[str, str]:
    """Whether a TensorRT engine runs attention as a fused kernel, from its inspector's layer
    information (``IEngineInspector.get_engine_information(LayerInformationFormat.JSON)``).
    Returns ``(verdict, basis)``, the verdict one of :data:`VERDICTS`.

    ``span_nodes``: the ONNX names of the model's Softmax / Attention nodes
    (:func:`attention_span_nodes`); the metadata of a TensorRT layer lists the ONNX nodes it
    came from, so a name there places that node inside the layer. Rules, in this order:

    1. **yes**: a layer's ``TacticName`` mentions ``fmha``/``mha``/``flash``/``attention``
       (TensorRT's fused multi-head attention kernels are named so);
    2. **likely**: a layer that swallowed a span node without naming its kernel: a Myelin
       region (``LayerType`` ``Myelin`` or a ``{ForeignNode[...]}`` name) or an
       ``IAttentionLayer`` (``LayerType`` ``Attention``). TensorRT fuses attention there, but
       Myelin may still run BMM1, Softmax and BMM2 as separate kernels and the inspector does
       not list the kernels inside, so this is an inference, said as such;
    3. **no**: a softmax is a layer of its own outside Myelin (``LayerType`` or name
       ``softmax``): BMM1, Softmax and BMM2 run as separate kernels;
    4. **unknown** otherwise: in particular an engine built without
       ``ProfilingVerbosity.DETAILED`` lists layer names only.

    A node's *name* saying ``attention`` is never evidence (only its identity as a span node
    is)."""
    data = json.loads(info) if isinstance(info, (str, bytes)) else info
    layers = list((data or {}).get("Layers", []) or [])
    if not layers:
        return "unknown", "the inspector listed no layers"
    detailed = any(isinstance(l, Mapping) for l in layers)

    def text(layer, key):
        v = layer.get(key, "") if isinstance(layer, Mapping) else ""
        return v if isinstance(v, str) else json.dumps(v)

    def name(layer):
        return layer if isinstance(layer, str) else text(layer, "Name")

    def onnx_nodes(layer):  # the ONNX nodes a layer came from, by its metadata
        meta = text(layer, "Metadata")
        return set(re.findall(r"\[ONNX Layer: ([^\]]+)\]", meta)) | {name(layer)}

    def is_myelin(layer):
        return text(layer, "LayerType").lower() == "myelin" or "{foreignnode[" in name(layer).lower()

    for layer in layers:
        m = _FUSED_KERNEL.search(text(layer, "TacticName"))
        if m:
            return "yes", (f"layer {name(layer)!r}: tactic {text(layer, 'TacticName')!r} names a "
                           f"fused attention kernel")
    span = set(span_nodes)
    for layer in layers:
        kind = text(layer, "LayerType")
        if is_myelin(layer) or kind.lower() == "attention":
            inside = sorted(onnx_nodes(layer) & span)
            if inside:
                where = "Myelin region" if is_myelin(layer) else "IAttention layer"
                return "likely", (f"{inside[0]} inside the {where} {name(layer)[:120]!r} "
                                  f"(inferred: the inspector does not list the kernels inside)")
    for layer in layers:
        if is_myelin(layer):
            continue
        if "softmax" in text(layer, "LayerType").lower() or "softmax" in name(layer).lower():
            return "no", (f"softmax is its own layer {name(layer)!r}"
                          + (f" ({text(layer, 'LayerType')})" if detailed else "")
                          + ": the attention runs as separate kernels")
    if not detailed:
        return "unknown", ("layer names only (engine built without ProfilingVerbosity.DETAILED):"
                           " no attention kernel or softmax named")
    return "unknown", ("no attention kernel, no layer holding the model's Softmax/Attention "
                       "node, and no softmax layer found")


def _inspect_engine(runner, dump: Path | None = None, span_nodes: Sequence[str] = ()
                    ) -> tuple[str, str]:
    """``fused_attention_from_inspector`` of a loaded TensorRT runner's engine (and the layer
    information written to ``dump``)."""
    engine, trt = getattr(runner, "engine", None), getattr(runner, "trt", None)
    if engine is None or trt is None:
        return "unknown", "the runner exposes no TensorRT engine to inspect"
    try:
        inspector = engine.create_engine_inspector()
        info = inspector.get_engine_information(trt.LayerInformationFormat.JSON)
    except Exception as exc:  # noqa: BLE001
        return "unknown", f"engine inspector failed ({type(exc).__name__}: {exc})"[:300]
    if dump is not None:
        with contextlib.suppress(OSError):
            dump.write_text(info if isinstance(info, str) else json.dumps(info))
    try:
        return fused_attention_from_inspector(info, span_nodes)
    except (ValueError, TypeError) as exc:
        return "unknown", f"unreadable inspector JSON ({type(exc).__name__}: {exc})"[:300]
