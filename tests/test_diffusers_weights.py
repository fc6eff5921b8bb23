"""A diffusers folder of sharded weights (what the real 20B transformer is saved as) is read
through its index, and diffusers' ``variant=`` is honoured, by `qkrope export` and
`qkrope refit`; a missing or extra shard, or a key in the wrong shard, is an error naming it."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")

from qkrope import diffusers_weights as dw  # noqa: E402
from qkrope.apps import refit  # noqa: E402
from qkrope.apps import tiny_pipeline as tp  # noqa: E402
from qkrope.cli import main  # noqa: E402

SHARD = "400KB"  # the tiny transformer (1.3 MB) in 4 shards


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("weights")
    model = tp.tiny_transformer()
    model.save_pretrained(str(d / "sharded"), max_shard_size=SHARD)
    model.save_pretrained(str(d / "variant"), max_shard_size=SHARD, variant="fp16")
    return model.state_dict(), d


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_shards_are_read_through_the_index(saved):
    want, d = saved
    files, weight_map = dw.weight_files(d / "sharded")
    assert len(files) == 4 and set(weight_map) == set(want)
    assert _same(refit.load_state_dict(str(d / "sharded")), want)
    assert _same(refit.load_state_dict(str(d / "variant"), variant="fp16"), want)


def test_a_variant_must_be_asked_for(saved):
    _, d = saved
    with pytest.raises(dw.DiffusersWeightsError, match="It holds the variant.s. fp16: pass "
                                                       "--variant fp16"):
        dw.weight_files(d / "variant")
    with pytest.raises(dw.DiffusersWeightsError, match="has no variant 'bf16' weights"):
        dw.weight_files(d / "variant", variant="bf16")


def _copy(saved, tmp_path, name="sharded"):
    _, d = saved
    target = tmp_path / name
    shutil.copytree(d / name, target)
    return target


def test_a_missing_shard_is_named(saved, tmp_path):
    d = _copy(saved, tmp_path)
    (d / "diffusion_pytorch_model-00003-of-00004.safetensors").unlink()
    with pytest.raises(dw.DiffusersWeightsError,
                       match="lacks 1 of the 4 shard.s. its index .* lists: "
                             "diffusion_pytorch_model-00003-of-00004.safetensors"):
        refit.load_state_dict(str(d))


def test_an_extra_shard_is_named(saved, tmp_path):
    d = _copy(saved, tmp_path)
    shutil.copy(d / "diffusion_pytorch_model-00001-of-00004.safetensors",
                d / "diffusion_pytorch_model-00001-of-00005.safetensors")
    with pytest.raises(dw.DiffusersWeightsError, match="holds shard.s. its index .* does not "
                                                       "list: diffusion_pytorch_model-00001-of"
                                                       "-00005.safetensors"):
        refit.load_state_dict(str(d))


def test_keys_in_the_wrong_shard_and_shards_without_index(saved, tmp_path):
    d = _copy(saved, tmp_path)
    index = d / dw.INDEX_NAME
    data = json.loads(index.read_text())
    key = next(iter(data["weight_map"]))
    data["weight_map"][key] = ("diffusion_pytorch_model-00004-of-00004.safetensors"
                               if data["weight_map"][key].startswith(
                                   "diffusion_pytorch_model-00001") else
                               "diffusion_pytorch_model-00001-of-00004.safetensors")
    index.write_text(json.dumps(data))
    with pytest.raises(dw.DiffusersWeightsError, match=f"does not hold the keys the index lists "
                                                       f"for it: .*{key}"):
        refit.load_state_dict(str(d))
    index.unlink()
    with pytest.raises(dw.DiffusersWeightsError, match="but no index"):
        refit.load_state_dict(str(d))


def test_export_reads_a_sharded_variant_and_refuses_a_missing_shard(saved, tmp_path, capsys):
    import onnx
    from onnx import numpy_helper

    want, d = saved
    out = tmp_path / "t.onnx"
    assert main(["export", "--model", "transformer", "--diffusers", str(d / "variant"),
                 "--variant", "fp16", "--out", str(out)]) == 0
    inits = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(out)).graph.initializer}
    used = [k for k in want if k in inits]
    assert len(used) > len(want) // 2
    assert all(torch.equal(torch.from_numpy(inits[k].copy()), want[k]) for k in used)
    broken = _copy(saved, tmp_path, "variant")
    (broken / "diffusion_pytorch_model.fp16-00002-of-00004.safetensors").unlink()
    capsys.readouterr()
    assert main(["export", "--model", "transformer", "--diffusers", str(broken), "--variant",
                 "fp16", "--out", str(tmp_path / "u.onnx")]) == 2
    assert "diffusion_pytorch_model.fp16-00002-of-00004.safetensors" in capsys.readouterr().err
    assert not (tmp_path / "u.onnx").exists()


def test_a_truncated_or_headless_shard_is_named_before_loading(saved, tmp_path):
    """A shard cut short (an interrupted copy) or without a readable header is a
    DiffusersWeightsError naming it, before diffusers' OSError or safetensors' error."""
    broken = _copy(saved, tmp_path)
    shard = broken / "diffusion_pytorch_model-00003-of-00004.safetensors"
    size = shard.stat().st_size
    with open(shard, "r+b") as f:
        f.truncate(size - 1)
    with pytest.raises(dw.DiffusersWeightsError,
                       match=rf"00003-of-00004\.safetensors is truncated: it holds {size - 1} "
                             rf"bytes, its header describes {size}\."):
        dw.weight_files(broken)
    for junk in (b"", b"\x01\x02", (10**6).to_bytes(8, "little") + b"{}"):
        shard.write_bytes(junk)
        with pytest.raises(dw.DiffusersWeightsError, match="00003-of-00004.safetensors is not a "
                                                           "safetensors file"):
            dw.weight_files(broken)


def test_export_names_a_truncated_single_file_and_only_its_own_flags(saved, tmp_path, capsys):
    """`qkrope export` on a folder whose one weights file is truncated: one line naming it;
    the missing-variant error names no flag export does not have (--state-dict is refit's)."""
    d = tmp_path / "single"
    tp.save_transformer(tp.tiny_transformer(), d)
    weights = d / dw.WEIGHTS_NAME
    weights.write_bytes(weights.read_bytes()[:-100])
    assert main(["export", "--model", "transformer", "--diffusers", str(d),
                 "--out", str(tmp_path / "t.onnx")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert "is truncated" in err[-1] and err[-1].startswith("qkrope export: error: ")
    assert "Traceback" not in "\n".join(err)
    assert main(["export", "--model", "transformer", "--diffusers", str(d), "--variant", "fp16",
                 "--out", str(tmp_path / "t.onnx")]) == 2
    err = capsys.readouterr().err
    assert "has no variant 'fp16' weights" in err and "--state-dict" not in err
    with pytest.raises(dw.DiffusersWeightsError, match="or pass --state-dict FILE"):
        refit.load_state_dict(str(d), variant="fp16")  # refit has --state-dict: it is offered


@pytest.mark.parametrize("key, value, match", [
    (None, [1], "holds a JSON list, not the object"),
    ("num_layers", "x", "'num_layers' must be a positive int"),
    ("attention_head_dim", None, "'attention_head_dim' must be a positive int"),
    ("num_attention_heads", -1, "'num_attention_heads' must be a positive int"),
    ("axes_dims_rope", [1], "'axes_dims_rope' must be three positive even ints"),
    ("axes_dims_rope", [8, 8, 8], "summing to attention_head_dim 32"),
    ("guidance_embeds", "yes", "'guidance_embeds' must be true or false"),
    # the streamed export never holds the weights: no memory bound, but sizes that cannot be
    # built even as placeholders, and weights of other shapes than the config's, are one line
    ("in_channels", 10**20, "the model its config.json describes cannot be built"),
    ("in_channels", 3, r"img_in.weight is .* the model built from config.json has \[64, 3\]"),
])
def test_a_wrong_config_json_is_one_line(tmp_path, capsys, key, value, match):
    """A config.json of the wrong JSON type or with sizes of the wrong type, sign or scale, or
    that the weights do not match: one line before (or instead of) diffusers' TypeError,
    AssertionError, RuntimeError or an allocation that cannot succeed."""
    d = tmp_path / "t"
    tp.save_transformer(tp.tiny_transformer(), d)
    cfg = json.loads((d / "config.json").read_text())
    if key is None:
        cfg = value
    else:
        cfg[key] = value
    (d / "config.json").write_text(json.dumps(cfg))
    assert main(["export", "--model", "transformer", "--diffusers", str(d),
                 "--out", str(tmp_path / "t.onnx")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert re.search(match, err[-1]) and err[-1].startswith("qkrope export: error: "), err
    assert "Traceback" not in "\n".join(err) and not (tmp_path / "t.onnx").exists()
