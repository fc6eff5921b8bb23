"""Whole diffusers transformer: a tiny random QwenImageTransformer2DModel (built in code, saved
to a temp dir) exported with --model transformer matches diffusers' own forward in ONNX Runtime;
the unmodified model does not export (complex RoPE)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from qkrope.cli import main
from qkrope import contract
from qkrope.runtime.inputs import make_inputs
from qkrope.sidecars import ModelInfo

diffusers = pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")

CONFIG = dict(patch_size=2, in_channels=16, out_channels=4, num_layers=3, attention_head_dim=32,
              num_attention_heads=2, joint_attention_dim=24, axes_dims_rope=(8, 12, 12))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    torch.manual_seed(0)
    model = diffusers.QwenImageTransformer2DModel(**CONFIG)
    with torch.no_grad():
        for name, p in model.named_parameters():  # non-trivial weights (default init zeroes some)
            p.copy_(torch.randn_like(p) * (0.2 if p.dim() > 1 else 0.05)
                    + (1.0 if p.dim() == 1 and "norm" in name else 0.0))
    path = tmp_path_factory.mktemp("tiny_qwen")
    model.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def exported(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("tr") / "tiny.onnx"
    assert main(["export", "--model", "transformer", "--diffusers", str(tiny_dir),
                 "--layers", "2", "--out", str(out)]) == 0
    return out


def test_graph(exported):
    model = onnx.load(str(exported))
    nodes = [n for n in model.graph.node if n.op_type == contract.OP_TYPE]
    assert len(nodes) == 4 and all(n.domain == contract.DOMAIN for n in nodes)  # 2 per block
    assert [i.name for i in model.graph.input] == [
        "hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask", "timestep",
        "img_cos_sin_cache", "txt_cos_sin_cache"]
    assert [o.name for o in model.graph.output] == ["sample"]
    # pos_embed (the complex RoPE tables) is not in the graph
    assert not any("pos_embed" in t.name for t in model.graph.initializer)
    info = ModelInfo.load(exported)
    assert info.model == "transformer" and info.config["num_layers_exported"] == 2
    assert info.config["diffusers_config"]["in_channels"] == 16
    assert info.input_shape("hidden_states", batch=1, img_tokens=9, txt_tokens=4) == (1, 9, 16)
    onnx.checker.check_model(str(exported), full_check=True)


@pytest.mark.parametrize("img_shapes,txt_len,batch", [
    ([(1, 6, 5)], 9, 2),
    ([(1, 4, 4), (1, 3, 5)], 7, 2),   # edit shapes
    ([(1, 3, 3)], 5, 1),
])
def test_matches_diffusers_forward(exported, tiny_dir, img_shapes, txt_len, batch):
    info = ModelInfo.load(exported)
    feeds = make_inputs(info, img_shapes, txt_len, batch, seed=7)
    sess = ort.InferenceSession(str(exported), providers=["CPUExecutionProvider"])
    got = sess.run(None, feeds)[0]
    ref_model = diffusers.QwenImageTransformer2DModel.from_pretrained(str(tiny_dir)).eval()
    ref_model.transformer_blocks = ref_model.transformer_blocks[:2]
    t = {k: torch.from_numpy(v) for k, v in feeds.items()}
    with torch.no_grad():
        ref = ref_model(hidden_states=t["hidden_states"],
                        encoder_hidden_states=t["encoder_hidden_states"],
                        encoder_hidden_states_mask=t["encoder_hidden_states_mask"],
                        timestep=t["timestep"], img_shapes=[img_shapes] * batch,
                        return_dict=False)[0].numpy()
    assert got.shape == ref.shape
    assert np.abs(got - ref).max() <= 1e-4 * np.abs(ref).max()


def test_check_passes_on_transformer(exported, capsys):
    assert main(["check", str(exported)]) == 0
    assert "PASSED" in capsys.readouterr().out


def test_unmodified_diffusers_model_fails_to_export(tiny_dir):
    """Why this project exists: diffusers' Qwen-Image RoPE is complex-valued."""
    model = diffusers.QwenImageTransformer2DModel.from_pretrained(str(tiny_dir)).eval()

    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.m = model

        def forward(self, hs, ehs, mask, t):
            return self.m(hidden_states=hs, encoder_hidden_states=ehs,
                          encoder_hidden_states_mask=mask, timestep=t,
                          img_shapes=[[(1, 4, 4)]] * 2, return_dict=False)[0]

    args = (torch.randn(2, 16, 16), torch.randn(2, 5, 24), torch.ones(2, 5, dtype=torch.bool),
            torch.rand(2))
    with pytest.raises(Exception) as exc:
        torch.onnx.export(Plain(), args, dynamo=True, verbose=False)
    chain, e = [], exc.value
    while e is not None:
        chain.append(str(e))
        e = e.__cause__
    assert "complex" in " ".join(chain).lower()
