"""`qkrope check` at scale (qkrope/apps/check_blocks.py): the transformer's reference holds one
block's weights at a time (read from the shards before the block runs, freed after) and gives
diffusers' own outputs bit for bit; `--blocks` compares every block's outputs (ONNX Runtime's,
marked as graph outputs) and names the first block that differs; `--layers K` compares a prefix
with the graph cut after block K-1. A tiny random 3-block config saved in small shards."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from qkrope.cli import main
from qkrope.families.qwen_image.tiny import tiny_transformer

diffusers = pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")

@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    model = tiny_transformer(0, num_layers=3)
    path = tmp_path_factory.mktemp("tiny_sharded")
    model.save_pretrained(str(path), max_shard_size="200KB")  # several shards and an index
    assert (path / "diffusion_pytorch_model.safetensors.index.json").is_file()
    return path


@pytest.fixture(scope="module")
def exported(tiny_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("blocks") / "tiny.onnx"
    assert main(["export", "--model", "transformer", "--diffusers", str(tiny_dir),
                 "--out", str(out)]) == 0
    return out


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    img_shapes = [(1, 4, 4)]
    return dict(hidden_states=torch.randn(2, 16, 16, generator=g),
                encoder_hidden_states=torch.randn(2, 5, 24, generator=g),
                encoder_hidden_states_mask=torch.ones(2, 5, dtype=torch.bool),
                timestep=torch.rand(2, generator=g), img_shapes=[img_shapes] * 2,
                return_dict=False)


def test_streamed_reference_is_diffusers_with_one_block_resident(tiny_dir):
    from qkrope.apps.check_blocks import StreamedTransformer

    full = diffusers.QwenImageTransformer2DModel.from_pretrained(str(tiny_dir)).eval()
    streamed = StreamedTransformer(tiny_dir, dtype=torch.float32)
    with torch.no_grad():
        want = full(**_inputs())[0]
        got = streamed(**_inputs())[0]
    assert torch.equal(got, want)  # the same weights through the same forward: bit for bit
    one_block = sum(p.numel() for p in full.transformer_blocks[0].parameters())
    assert streamed.block_elements == [one_block] * 3
    assert streamed.peak_block_elements == one_block  # never two blocks, never the model
    assert all(p.device.type == "meta" for p in streamed.model.transformer_blocks.parameters())
    assert sorted(streamed.block_outputs) == [0, 1, 2]
    # a prefix: two blocks, the first outputs the same
    two = StreamedTransformer(tiny_dir, dtype=torch.float32, num_layers=2)
    with torch.no_grad():
        two(**_inputs())
    assert torch.equal(two.block_outputs[1]["img"], streamed.block_outputs[1]["img"])


def test_check_blocks_compares_every_block(exported, capsys, tmp_path):
    assert main(["check", str(exported), "--blocks", "--workdir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "image/text outputs of blocks 0-2" in out and "one block" in out, out
    for name in ("sample", "block0.img", "block0.txt", "block1.img", "block1.txt",
                 "block2.img"):
        assert f" {name} " in out, out
    assert "PASSED" in out


def _plant(exported, tmp_path, key: str):
    """A copy of the export with one weight of ``key`` scaled, its sidecar re-pointed at it."""
    from qkrope._fileio import sha256_file

    model = onnx.load(str(exported))
    target = next(t for t in model.graph.initializer if t.name == key)
    arr = numpy_helper.to_array(target).copy()
    arr *= 1.5
    target.CopyFrom(numpy_helper.from_array(arr, target.name))
    bad = tmp_path / "bad.onnx"
    onnx.save(model, str(bad))
    side = json.loads(open(str(exported) + ".json").read())
    side["model_sha256"] = sha256_file(bad)
    open(str(bad) + ".json", "w").write(json.dumps(side))
    return bad


def test_a_wrong_weight_in_one_block_is_caught_and_named(exported, tmp_path, capsys):
    bad = _plant(exported, tmp_path, "transformer_blocks.1.img_mlp.net.2.weight")
    assert main(["check", str(bad), "--blocks"]) == 1
    out = capsys.readouterr().out
    assert "first block that differs: block 1" in out, out
    rows = {line.split()[2]: line.split()[-1] for line in out.splitlines()
            if line.startswith("onnxrt ")}
    assert rows["block0.img"] == rows["block0.txt"] == "pass", out
    assert rows["block1.img"] == "FAIL" and rows["sample"] == "FAIL", out
    # a prefix before the planted block agrees
    assert main(["check", str(bad), "--layers", "1"]) == 0
    out = capsys.readouterr().out
    assert "--layers 1: the graph cut after block 0" in out and " sample " not in out, out


def test_layers_cuts_the_graph_and_its_weights(exported):
    from qkrope.apps.check_blocks import marked_model

    model, names = marked_model(str(exported), num_blocks=3, layers=1)
    assert names == ["block0.img", "block0.txt"]
    assert [o.name for o in model.graph.output] == names
    inits = [t.name for t in model.graph.initializer]
    assert any(n.startswith("transformer_blocks.0.") for n in inits)
    assert not any(n.startswith(("transformer_blocks.1.", "transformer_blocks.2.", "proj_out"))
                   for n in inits), inits
    whole, names = marked_model(str(exported), num_blocks=3, layers=None)
    assert "sample" in [o.name for o in whole.graph.output] and len(names) == 5


def test_block_flags_are_checked_first(monkeypatch):
    from _tiny_model import model as attention_info

    from qkrope.apps import check
    from qkrope.errors import InputError

    info = attention_info()
    with pytest.raises(InputError, match="--blocks compares the blocks of a whole transformer"):
        check._check_block_arguments("a.onnx", info, blocks=True, layers=None, engine=None,
                                     onnxrt=True)
    info.model = "transformer"
    info.config.num_layers_exported = 3
    for bad in (0, 4):
        with pytest.raises(InputError, match=f"--layers {bad}: a.onnx has 3 blocks"):
            check._check_block_arguments("a.onnx", info, blocks=False, layers=bad,
                                         engine=None, onnxrt=True)
    with pytest.raises(InputError, match="drop --engine"):
        check._check_block_arguments("a.onnx", info, blocks=False, layers=2, engine="m.engine",
                                     onnxrt=True)
    np.testing.assert_equal(check._check_block_arguments(
        "a.onnx", info, blocks=True, layers=3, engine=None, onnxrt=True), None)


def test_shard_reader_reads_by_offsets_and_says_what_is_wrong(tiny_dir, tmp_path):
    import shutil

    from qkrope.errors import QkropeError

    from safetensors.torch import load_file

    from qkrope.apps.check_blocks import BlockCheckError, ShardReader

    reader = ShardReader(tiny_dir)
    key = "transformer_blocks.2.attn.to_q.weight"
    want = load_file(str(tiny_dir / reader.weight_map[key]))[key]
    assert torch.equal(reader.get_many([key], torch.float32)[key], want)
    assert reader.get_many([key], torch.float16)[key].dtype == torch.float16
    with pytest.raises(BlockCheckError, match="has no tensor 'nope'"):
        reader.get_many(["nope"], torch.float32)
    broken = tmp_path / "broken"
    shutil.copytree(tiny_dir, broken)
    shard = broken / reader.weight_map[key]
    shard.write_bytes(shard.read_bytes()[:-8])  # cut inside its last tensor
    with pytest.raises(QkropeError, match="truncated"):  # named before any tensor is read
        ShardReader(broken)


def test_a_graph_without_block_scopes_is_one_clear_error(exported, tmp_path):
    from qkrope.apps.check_blocks import BlockCheckError, marked_model

    model = onnx.load(str(exported))
    for node in model.graph.node:
        del node.metadata_props[:]
    plain = tmp_path / "plain.onnx"
    onnx.save(model, str(plain))
    with pytest.raises(BlockCheckError, match=r"block\(s\) \[0, 1, 2\] cannot be found"):
        marked_model(str(plain), num_blocks=3, layers=None)


def test_block_numbering_over_a_familys_block_lists():
    """Issue 35: blocks are numbered in execution order through the record's block lists (FLUX:
    the double-stream ones, then the single-stream ones), and a failing block's index names its
    module back; one list (Qwen-Image) numbers transformer_blocks from 0."""
    from qkrope import families
    from qkrope.apps.check_blocks import block_module, block_offsets

    flux1 = families.by_name("flux1")
    offsets = block_offsets(flux1.block_lists, {"num_layers": 19, "num_single_layers": 38})
    assert offsets == {"transformer_blocks": 0, "single_transformer_blocks": 19}
    assert [block_module(i, offsets) for i in (0, 18, 19, 56)] == [
        "transformer_blocks.0", "transformer_blocks.18", "single_transformer_blocks.0",
        "single_transformer_blocks.37"]
    qwen = block_offsets(families.by_name("qwen-image").block_lists, {"num_layers": 60})
    assert block_module(7, qwen) == block_module(7, None) == "transformer_blocks.7"


def test_a_patchified_latents_block_output_is_found_among_its_modulations():
    """Issue 35 (Cosmos-Predict2): a 5-D latent's image token axis is named by the product of
    its token axes (``latent_frames*s38*s71``); of two values of one block read outside it at
    the model's width (a per-token modulation the next block reuses, and the block's stream),
    the block's output is the one computed from the other."""
    from onnx import TensorProto, helper

    from qkrope.apps.check_blocks import NAME_SCOPES_KEY, find_block_outputs, stream_of_axis

    assert stream_of_axis("latent_frames*s38*s71") == "img"
    assert stream_of_axis("latent_frames*latent_height_tokens*latent_width") == "img"
    assert stream_of_axis("img_tokens") == "img" and stream_of_axis("txt_tokens") == "txt"
    for other in ("latent_frames*batch", "s38*s71", "s38*s71*Min(4, latent_frames)", "batch"):
        assert stream_of_axis(other) is None, other

    tokens = "latent_frames*s38*s71"

    def node(op, inputs, output, block):
        n = helper.make_node(op, inputs, [output], name=output)
        helper.set_metadata_props(n, {NAME_SCOPES_KEY: repr([f"transformer_blocks.{block}"])})
        return n

    def value(name):
        return helper.make_tensor_value_info(name, TensorProto.FLOAT, ["batch", tokens, 4])

    graph = helper.make_graph(
        [node("Sigmoid", ["x"], "mod", 0), node("Mul", ["x", "mod"], "out0", 0),
         node("Add", ["out0", "mod"], "out1", 1), helper.make_node("Neg", ["out1"], ["y"])],
        "g", [value("x")], [value("y")],
        value_info=[value("mod"), value("out0"), value("out1")])
    found = find_block_outputs(helper.make_model(graph))
    assert found == {0: {"img": "out0"}, 1: {"img": "out1"}}


def test_a_padded_token_axis_is_its_streams():
    """Issue 35: a block output whose token axis the graph padded (the exporter's symbolic dim,
    e.g. image tokens padded to a multiple of 32) is still its stream's; a padding alone, a
    difference or a multiple is no stream's; a joined axis is one in either order."""
    from qkrope.apps.check_blocks import stream_of_axis

    pad = "(Mod(32 - (Mod(img_tokens, 32)), 32))"
    assert [stream_of_axis(a) for a in ("img_tokens", "txt_tokens", "txt_tokens + img_tokens",
                                     "img_tokens + txt_tokens", f"img_tokens + {pad}",
                                     f"txt_tokens + img_tokens + {pad}")] == [
        "img", "txt", "joined", "joined", "img", "joined"]
    assert [stream_of_axis(a) for a in (pad[1:-1], "img_tokens - 1", "2*img_tokens", "rows")] == [
        None] * 4


def test_a_stream_is_named_by_its_token_axis():
    """Issue 35: a block output's token axis names its stream: the packed-token names, the
    product of a 5-D latent's token grid as torch.onnx writes it (named latent axes where the
    patch is 1, unnamed ``s<n>`` symbols where it is wider, with one named axis at least) and a
    sum of the text axes a model joins to its text; nothing else."""
    from qkrope.apps.check_blocks import stream_of_axis

    for name, stream in [("img_tokens", "img"), ("txt_tokens", "txt"),
                         ("txt_tokens + img_tokens", "joined"),
                         ("latent_height*latent_frames*latent_width", "img"),
                         ("s38*s71*latent_frames", "img"),
                         ("latent_frames_tokens*latent_height_tokens*latent_width_tokens", "img"),
                         ("image_embed_tokens + txt2_tokens + txt_tokens", "txt"),
                         ("s1*s2", None), ("latent_frames", None), ("batch*s3", None),
                         ("latent_height*latent_frames*latent_width + txt_tokens", None),
                         ("txt_tokens + 1", None), ("", None),
                         # history latents joined before the latent: a sum of token grids
                         ("s38*clean_frames*s71 + s38*s71*latent_frames", "img"),
                         ("clean_frames + latent_frames", None),
                         ("2*latent_frames + clean_frames", None),
                         ("latent_frames*s3*s4 + (Mod(latent_frames, 4))", None)]:
        assert stream_of_axis(name) == stream, name
