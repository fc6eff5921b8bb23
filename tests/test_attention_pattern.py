"""Every exported attention is in the pattern TensorRT fuses from primitive layers: BMM1 on a
pre-scaled Q and a (transposed) pre-scaled K -> one additive mask bias (optional) -> Softmax ->
BMM2, and nothing else between Softmax and BMM2. The walk fails on any other node in
that span. With ``--attention onnx23`` every attention is one opset-23 ``Attention`` node on the
[B, H, S, D] q/k/v with the bool text mask, and no Softmax is left. The values are covered by
the parity tests (tests/test_onnx_export.py, tests/test_transformer_export.py)."""

from __future__ import annotations

import onnx
import pytest

from qkrope.cli import main


def attention_spans(model: onnx.ModelProto) -> list[str]:
    """One line per Softmax describing its span; raises AssertionError on a foreign node."""
    g = model.graph
    producer = {o: n for n in g.node for o in n.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for n in g.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)

    def src(name: str) -> onnx.NodeProto | None:
        return producer.get(name)

    spans = []
    for sm in (n for n in g.node if n.op_type == "Softmax"):
        users = consumers.get(sm.output[0], [])
        assert [u.op_type for u in users] == ["MatMul"], (
            f"{sm.name}: the Softmax output feeds {[u.op_type for u in users]}, not one BMM2 MatMul")
        assert users[0].input[0] == sm.output[0], f"{sm.name}: the Softmax is not BMM2's left operand"
        before = src(sm.input[0])
        bias = None
        if before is not None and before.op_type == "Add":
            kinds = [getattr(src(i), "op_type", "input") for i in before.input]
            assert "MatMul" in kinds, f"{sm.name}: the Add before the Softmax adds no BMM1 ({kinds})"
            bias = kinds[1 - kinds.index("MatMul")]
            bmm1 = src(before.input[kinds.index("MatMul")])
        else:
            bmm1 = before
        assert bmm1 is not None and bmm1.op_type == "MatMul", (
            f"{sm.name}: the Softmax input comes from {getattr(bmm1, 'op_type', 'a graph input')}, "
            f"expected BMM1 (MatMul) or BMM1 + mask bias")
        q, k = (src(i) for i in bmm1.input)
        assert q is not None and q.op_type == "Mul", f"{bmm1.name}: Q is not pre-scaled ({getattr(q, 'op_type', None)})"
        if k is not None and k.op_type == "Transpose":
            k = src(k.input[0])
        assert k is not None and k.op_type == "Mul", f"{bmm1.name}: K is not pre-scaled ({getattr(k, 'op_type', None)})"
        spans.append(f"Mul/Mul -> MatMul -> {'Add(' + bias + ') -> ' if bias else ''}Softmax -> MatMul")
    return spans


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    d = tmp_path_factory.mktemp("pattern")
    out = {}
    for name, args in (("attention", ["--heads", "2", "--head-dim", "16"]),
                       ("attention_bf16", ["--heads", "2", "--head-dim", "16", "--dtype", "bf16"]),
                       ("attention_onnx23", ["--heads", "2", "--head-dim", "16",
                                             "--attention", "onnx23"])):
        out[name] = d / f"{name}.onnx"
        assert main(["export", *args, "--out", str(out[name])]) == 0
    return out


@pytest.mark.parametrize("name", ["attention", "attention_bf16"])
def test_attention_block_pattern(exported, name):
    model = onnx.load(str(exported[name]))
    spans = attention_spans(model)
    assert len(spans) == 1 and "Add(Where)" in spans[0], spans  # the text mask is the one bias
    assert not any(n.op_type in ("IsNaN", "IsInf") for n in model.graph.node)


def test_transformer_pattern(tmp_path):
    pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")
    from qkrope.apps import tiny_pipeline as tp

    tp.save_transformer(tp.tiny_transformer(), tmp_path / "t")
    assert main(["export", "--model", "transformer", "--diffusers", str(tmp_path / "t"),
                 "--out", str(tmp_path / "t.onnx")]) == 0
    model = onnx.load(str(tmp_path / "t.onnx"))
    assert len(attention_spans(model)) == tp.TRANSFORMER_CONFIG["num_layers"]
    assert not any(n.op_type in ("IsNaN", "IsInf") for n in model.graph.node)


def test_the_walk_fails_on_a_node_between_softmax_and_bmm2(exported):
    """The check can fail: a node inserted between Softmax and BMM2 (what SDPA's export did)."""
    model = onnx.load(str(exported["attention"]))
    g = model.graph
    sm = next(n for n in g.node if n.op_type == "Softmax")
    bmm2 = next(n for n in g.node if sm.output[0] in n.input)
    guard = onnx.helper.make_node("Identity", [sm.output[0]], ["guarded"], name="guard")
    bmm2.input[list(bmm2.input).index(sm.output[0])] = "guarded"
    g.node.insert(list(g.node).index(bmm2), guard)
    with pytest.raises(AssertionError, match="not one BMM2"):
        attention_spans(model)


def onnx23_attentions(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    """The opset-23 Attention nodes; AssertionError when the primitive pattern is left too."""
    assert {o.domain: o.version for o in model.opset_import}.get("", 0) >= 23
    assert model.ir_version == 11  # the IR version ONNX pairs with opset 23
    assert not any(n.op_type == "Softmax" for n in model.graph.node)
    nodes = [n for n in model.graph.node if n.op_type == "Attention" and n.domain == ""]
    inputs = {i.name: i for i in model.graph.input}
    for n in nodes:
        assert len(n.input) >= 4 and n.input[3], f"{n.name}: no attn_mask"
        assert not [a for a in n.attribute if a.name in ("is_causal",) and a.i]
    assert "encoder_hidden_states_mask" in inputs
    return nodes


def test_onnx23_attention_block(exported):
    model = onnx.load(str(exported["attention_onnx23"]))
    assert len(onnx23_attentions(model)) == 1


def test_onnx23_transformer(tmp_path):
    pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")
    from qkrope.apps import tiny_pipeline as tp

    tp.save_transformer(tp.tiny_transformer(), tmp_path / "t")
    assert main(["export", "--model", "transformer", "--diffusers", str(tmp_path / "t"),
                 "--attention", "onnx23", "--out", str(tmp_path / "t.onnx")]) == 0
    model = onnx.load(str(tmp_path / "t.onnx"))
    assert len(onnx23_attentions(model)) == tp.TRANSFORMER_CONFIG["num_layers"]


def test_onnx23_needs_opset_23(tmp_path, capsys):
    assert main(["export", "--heads", "2", "--head-dim", "16", "--attention", "onnx23",
                 "--opset", "18", "--out", str(tmp_path / "a.onnx")]) != 0
    assert "--attention onnx23 needs --opset 23" in capsys.readouterr().err
