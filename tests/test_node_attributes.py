"""contract.NodeAttributes: the node's eps, interleaved and rounding as one checked value, from
the user's keywords to the node and the sidecar (stored once)."""

from __future__ import annotations

import json

import onnx
import pytest

from _tiny_model import one_node_model

from qkrope import contract
from qkrope.contract import NodeAttributes
from qkrope.errors import InputError


def test_checked_on_creation_and_normalised():
    a = NodeAttributes(eps=1e-5, interleaved=0, rounding=1)
    assert (a.eps, a.interleaved, a.rounding) == (1e-5, False, 1)
    assert type(a.interleaved) is bool and type(a.rounding) is int
    for kw, match in ((dict(eps=0.0), "eps must be"), (dict(eps=1e-50), "float32 stores"),
                      (dict(interleaved="no"), "interleaved must be"),
                      (dict(rounding=3), "rounding must be"),
                      (dict(rounding=True), "rounding must be")):
        with pytest.raises(InputError, match=match):
            NodeAttributes(**kw)


def test_node_form_round_trips():
    assert NodeAttributes().to_node() == contract.node_attributes()
    a = NodeAttributes(1e-5, False, 1)
    assert NodeAttributes.from_node(a.to_node()) == a
    # every attribute but those left off at their default (norm_scope 0)
    assert set(a.to_node()) == {x.name for x in contract.ATTRIBUTES if not x.omitted_at_default}
    assert a.as_kwargs() == {"eps": 1e-5, "interleaved": False, "rounding": 1}


def test_the_attention_block_holds_one_record():
    from qkrope.export import QwenImageAttention

    m = QwenImageAttention(64, 2, 32, eps=1e-5, interleaved=False, rounding=1)
    assert m.attributes == NodeAttributes(1e-5, False, 1)
    assert (m.eps, m.interleaved, m.rounding) == (1e-5, False, 1)
    with pytest.raises(InputError, match="rounding must be"):
        QwenImageAttention(64, 2, 32, rounding=3)


def test_an_export_writes_the_record_on_every_node_and_once_in_the_sidecar(tmp_path):
    from qkrope.export.onnx_export import export_attention

    want = NodeAttributes(1e-5, False, 1)
    info, _ = export_attention(tmp_path / "m.onnx", heads=2, head_dim=32, **want.as_kwargs())
    assert info.node_attributes == want
    model = onnx.load(str(tmp_path / "m.onnx"), load_external_data=False)
    nodes = [n for n in model.graph.node if n.op_type == contract.OP_TYPE]
    assert len(nodes) == 2
    for n in nodes:
        got = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        got = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in got.items()}
        assert got == pytest.approx(want.to_node())
    side = json.loads((tmp_path / "m.onnx.json").read_text())
    assert side["node_attributes"] == want.to_node()
    assert not {"eps", "interleaved", "rounding"} & set(side["config"])


def test_node_validator_takes_every_rounding_mode_and_refuses_others():
    for mode in contract.ROUNDING_MODES:
        assert contract.validate_qknorm_rope_nodes(one_node_model(rounding=mode), where="m.onnx") == 1
    with pytest.raises(contract.NodeContractError, match=r"'rounding' = 3 is invalid: expected "
                                                         r"0 \(one rounding\), 1 .* or 2 \(rounded twice"):
        contract.validate_qknorm_rope_nodes(one_node_model(rounding=3), where="m.onnx")
    assert contract.ROUNDING_TWO_STEPS == 2 and NodeAttributes(rounding=contract.ROUNDING_TWO_STEPS).rounding == 2
