"""Models whose QKNormRoPE nodes break the node contract (docs/spec.md section 4), made by
editing a good model's node attributes with onnx helpers; and broken ONNX files (truncated, not
ONNX, empty). Shared by the consumers' tests: check, load, build, triton-repo, bench."""

from __future__ import annotations

import shutil
from pathlib import Path

from qkrope import contract


def _set(name, value):
    def mutate(node):
        from onnx import helper

        kept = [a for a in node.attribute if a.name != name]
        del node.attribute[:]
        node.attribute.extend(kept + [helper.make_attribute(name, value)])
    return mutate


def _drop(name):
    def mutate(node):
        kept = [a for a in node.attribute if a.name != name]
        del node.attribute[:]
        node.attribute.extend(kept)
    return mutate


# case id -> (the attribute the error must name, the edit made to the first QKNormRoPE node)
BAD_NODE_CASES = {
    "interleaved=5": ("interleaved", _set("interleaved", 5)),
    "rounding-STRING": ("rounding", _set("rounding", "0")),
    "no-plugin_namespace": ("plugin_namespace", _drop("plugin_namespace")),
    "epsilon=-1": ("epsilon", _set("epsilon", -1.0)),
}


def write_bad_copy(src: Path, dst: Path, case: str) -> tuple[Path, str, str]:
    """Copy ``src`` (and its sidecar) to ``dst`` with the first QKNormRoPE node edited as
    ``case`` says; returns (dst, the attribute name the error must give, the node's name)."""
    import onnx

    attribute, mutate = BAD_NODE_CASES[case]
    model = onnx.load(str(src))
    node = next(n for n in model.graph.node
                if n.op_type == contract.OP_TYPE and n.domain == contract.DOMAIN)
    mutate(node)
    onnx.save(model, str(dst))
    side = Path(str(src) + ".json")
    if side.exists():
        shutil.copy(side, str(dst) + ".json")
    return dst, attribute, node.name


# case id -> bytes of a file that is not a readable ONNX model, from the good model's bytes
BROKEN_FILES = {
    "truncated": lambda good: good[: len(good) // 2],
    "not-onnx": lambda good: b"this is a text file, not an ONNX model\n" * 4,
    "empty": lambda good: b"",
}


def write_broken_copy(src: Path, dst: Path, case: str) -> Path:
    dst.write_bytes(BROKEN_FILES[case](Path(src).read_bytes()))
    side = Path(str(src) + ".json")
    if side.exists():
        shutil.copy(side, str(dst) + ".json")
    return dst
