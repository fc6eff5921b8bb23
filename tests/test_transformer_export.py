"""Whole diffusers transformer: a tiny random QwenImageTransformer2DModel (built in code, saved
to a temp dir) exported with --model transformer matches diffusers' own forward in ONNX Runtime;
the unmodified model does not export (complex RoPE) (export/transformer_export.py)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from qkrope.cli import main
from qkrope.families.qwen_image.tiny import tiny_transformer
from qkrope import contract
from qkrope.runtime.inputs import make_inputs
from qkrope.sidecars import ModelInfo

diffusers = pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    model = tiny_transformer(0, num_layers=3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".norm_added_" in name:  # diffusers' init: equal parameters, kept apart by name
                p.fill_(1.0)
    path = tmp_path_factory.mktemp("tiny_qwen")
    model.save_pretrained(str(path))
    return path


@pytest.fixture(scope="module")
def exported(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("tr") / "tiny.onnx"
    assert main(["export", "--model", "transformer", "--diffusers", str(tiny_dir),
                 "--layers", "2", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def exported_onnx23(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("tr23") / "tiny23.onnx"
    assert main(["export", "--model", "transformer", "--diffusers", str(tiny_dir),
                 "--layers", "2", "--attention", "onnx23", "--out", str(out)]) == 0
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
    assert info.model == "transformer" and info.config.num_layers_exported == 2
    assert info.config.diffusers_config["in_channels"] == 16
    assert info.config.family == "qwen-image" and info.config.rope_theta == 10000
    assert info.input_shape("hidden_states", batch=1, img_tokens=9, txt_tokens=4) == (1, 9, 16)
    onnx.checker.check_model(str(exported), full_check=True)


@pytest.mark.parametrize("form", ["primitive", "onnx23"])
@pytest.mark.parametrize("img_shapes,txt_len,batch", [
    ([(1, 6, 5)], 9, 2),
    ([(1, 4, 4), (1, 3, 5)], 7, 2),   # edit shapes
    ([(1, 3, 3)], 5, 1),
])
def test_matches_diffusers_forward(request, tiny_dir, form, img_shapes, txt_len, batch):
    exported = request.getfixturevalue("exported" if form == "primitive" else "exported_onnx23")
    info = ModelInfo.load(exported)
    assert info.config.attention == form
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


# the keys of a --layers 2 export of the 3-block model that are no initializer: block 2, and the
# last exported block's text-stream output path (to_add_out, txt_mlp), which no output uses
def _expected_not_in_graph(keys):
    dead = ("transformer_blocks.1.attn.to_add_out.", "transformer_blocks.1.txt_mlp.",
            "transformer_blocks.2.")
    return sorted(k for k in keys if k.startswith(dead))


def test_every_parameter_is_its_own_initializer(exported, tiny_dir):
    """What refit by name needs: every state-dict key the graph uses is an initializer of that
    name holding exactly the state-dict tensor (not a transposed copy, not merged into an equal
    parameter: the four norm_added_* weights are all ones), and the sidecar lists both sets."""
    from onnx import numpy_helper

    model = onnx.load(str(exported))
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    sd = diffusers.QwenImageTransformer2DModel.from_pretrained(str(tiny_dir)).state_dict()
    config = ModelInfo.load(exported).config
    assert config.parameters_not_in_graph == _expected_not_in_graph(sd)
    assert config.parameters == [k for k in sd if k not in config.parameters_not_in_graph]
    for key in config.parameters:
        np.testing.assert_array_equal(inits[key], sd[key].numpy(), err_msg=key)
    ones = [k for k in config.parameters if ".norm_added_" in k]
    assert len(ones) == 4 and all((inits[k] == 1).all() for k in ones)
    users = {i for n in model.graph.node for i in n.input}
    assert all(k in users for k in ones)  # each used by its own node input


def test_refit_name_map_covers_the_export(exported, tiny_dir):
    """qkrope refit over an engine whose weights are the export's initializers (the ONNX
    parser names weights by initializer name): every parameter refitted from the diffusers
    folder's state dict, the export's own constants kept, the unused keys skipped."""
    import fake_tensorrt as ft
    from onnx import numpy_helper

    from qkrope.apps import refit

    model = onnx.load(str(exported))
    weights = {t.name: ("FLOAT", numpy_helper.to_array(t).size) for t in model.graph.initializer}
    engine = ft.RefittableEngine(weights)
    trt, _ = ft.make_fake_trt()
    config = ModelInfo.load(exported).config
    sd = refit.load_state_dict(diffusers=str(tiny_dir))
    report = refit.refit_engine(trt, engine, None, sd, parameters=config.parameters,
                                not_in_graph=config.parameters_not_in_graph)
    assert report.refitted == sorted(config.parameters) and not report.not_covered
    assert not report.not_in_engine
    assert report.not_in_graph == _expected_not_in_graph(sd)
    assert report.constants == sorted(set(weights) - set(sd)) and report.constants
    assert engine.refits == [sorted(config.parameters)]


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
