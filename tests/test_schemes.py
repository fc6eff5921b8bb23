"""The generic runtime pieces of the family layout, on their own (no export, no backend): the
position schemes' refusals before anything is built (a stride-0 view claims millions of rows),
the drop-in's one-line answers to another family's pipeline arguments and to conditioning of the
wrong type, the data model of what comes next (5-D video latents, per-sample text lengths,
streams normalised but not rotated), and the scheme a Triton rope model picks by parameter."""

from __future__ import annotations

import re

import tracemalloc
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from qkrope.errors import InputError
from qkrope.families import by_name
from qkrope.runtime import caches as caches_mod
from qkrope.runtime import latents, profiles, schemes
from qkrope.runtime.caches import build_rope_caches, checked_setting

FLUX1 = by_name("flux1")
QWEN = by_name("qwen-image")


def _flux_ids(tokens=64):
    """FLUX.1-style ids: text all zero, image (0, row, column) of an 8-wide grid."""
    img = np.stack([np.zeros(tokens), np.arange(tokens) // 8, np.arange(tokens) % 8], 1)
    return torch.zeros(4, 3), torch.from_numpy(img.astype(np.float32))


# --------------------------------------------------------------------------------------------
# Issue 34, class 4: sizes bounded by what the inputs hold, before anything is built
# --------------------------------------------------------------------------------------------

def _peak_numpy_bytes(fn):
    """The peak of Python/numpy allocations while ``fn`` runs (tracemalloc sees numpy's)."""
    tracemalloc.start()
    try:
        result = fn()
        return result, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_a_stride0_batch_of_ids_is_one_item(dtype, monkeypatch):
    """``ids.expand(3_000_000, 64, 3)`` holds one item of 64 x 3 values: the caches are that
    item's, built without a copy of the claimed batch (3e6 x 64 x 3 values would be 2.3 GiB as
    float32; the bound below is 4 MiB, a thousand times less than even its bool comparison)."""
    txt, img = _flux_ids(64)
    want = caches_mod.build_flux_rope_caches(txt, img, axes_dims=(16, 56, 56), theta=10000)
    converted = []
    real_float = torch.Tensor.float
    monkeypatch.setattr(torch.Tensor, "float",
                        lambda self, *a, **k: converted.append(self.numel()) or
                        real_float(self, *a, **k))
    caches_mod._build_cached.cache_clear()
    got, peak = _peak_numpy_bytes(lambda: caches_mod.build_flux_rope_caches(
        txt.to(dtype).expand(3_000_000, -1, -1), img.to(dtype).expand(3_000_000, -1, -1),
        axes_dims=(16, 56, 56), theta=10000))
    assert torch.equal(got.img, want.img) and torch.equal(got.txt, want.txt)
    assert peak < 4 * 2**20, peak
    assert all(n <= 64 * 3 for n in converted), converted  # only one item ever converted


def test_a_stride0_token_axis_is_refused_from_its_shape():
    """A view of 3 values that claims 10^8 tokens: refused by the byte bound from the shape,
    before any value is read or converted."""
    ids = torch.zeros(1, 3).expand(100_000_000, 3)

    def build():
        with pytest.raises(InputError, match=r"100000004 rows x 128 fp32.*GiB limit"):
            caches_mod.build_flux_rope_caches(torch.zeros(4, 3), ids, axes_dims=(16, 56, 56),
                                              theta=10000)

    _, peak = _peak_numpy_bytes(build)
    assert peak < 2**20, peak


def test_the_drop_in_takes_a_stride0_batch_of_ids_without_comparing_it():
    runner = _FakeRunner(FLUX1, _flux_cfg())
    model = _dropin(runner, FLUX1)
    txt, img = _flux_ids(16)
    model(torch.zeros(2, 16, 4), torch.zeros(2, 4, 8), pooled_projections=torch.zeros(2, 6),
          timestep=torch.tensor(0.5), img_ids=img[None].expand(2, -1, -1),
          txt_ids=txt[None].expand(2, -1, -1), guidance=torch.tensor([3.5, 3.5]),
          return_dict=False)
    assert runner.calls and runner.calls[-1]["caches"].img.shape == (16, 16)


# --------------------------------------------------------------------------------------------
# The drop-in with a fake runner (the generic part and the family parts)
# --------------------------------------------------------------------------------------------

class _FakeIO:
    def __init__(self, record, cfg, axes):
        self.config = SimpleNamespace(diffusers_config=cfg, num_layers_exported=None,
                                      family=record.name, axes_dims_rope=list(axes),
                                      rope_theta=None)
        self.roles = {r: r for r in ("hidden_states", "encoder_hidden_states", "timestep",
                                     "img_cache", "txt_cache")}
        if record.name == "flux1":
            self.roles.update(pooled_projections="pooled_projections", guidance="guidance")
        else:
            self.roles["encoder_hidden_states_mask"] = "encoder_hidden_states_mask"
        self.source = f"fake-{record.name}.onnx"
        self.head_dim = sum(axes)

    def input(self, name):
        return SimpleNamespace(dtype="float32")


class _FakeRunner:
    """What the drop-in uses of a runner; records each call, returns zeros of the latent."""

    device = torch.device("cpu")
    copy_outputs = True
    backend = "fake"

    def __init__(self, record, cfg, axes=(4, 6, 6)):
        self.io = _FakeIO(record, cfg, axes)
        self.calls = []

    def __call__(self, hidden_states, encoder_hidden_states, caches, mask, timestep,
                 conditioning=None):
        self.calls.append(dict(caches=caches, mask=mask, timestep=timestep,
                               conditioning=conditioning))
        return torch.zeros_like(hidden_states)


def _flux_cfg():
    return {"_class_name": "FluxTransformer2DModel", "guidance_embeds": True,
            "pooled_projection_dim": 6, "num_layers": 1}


def _qwen_cfg():
    return {"_class_name": "QwenImageTransformer2DModel", "joint_attention_dim": 8,
            "num_layers": 1}


def _dropin(runner, record):
    from qkrope import families

    return families.hooks(record, "dropin").dropin_class(record)(runner, record)


def test_the_flux_drop_in_refuses_qwen_image_pipeline_arguments_in_one_line():
    """Issue 34, class 6: Qwen-Image's img_shapes (and mask) to the FLUX drop-in."""
    model = _dropin(_FakeRunner(FLUX1, _flux_cfg()), FLUX1)
    with pytest.raises(InputError) as info:
        model(hidden_states=torch.zeros(1, 16, 4), encoder_hidden_states=torch.zeros(1, 4, 8),
              encoder_hidden_states_mask=torch.ones(1, 4), timestep=torch.tensor([0.5]),
              img_shapes=[[(1, 4, 4)]], return_dict=False)
    text = str(info.value)
    assert "\n" not in text
    assert "received encoder_hidden_states_mask, img_shapes" in text
    assert "Qwen-Image's pipelines pass" in text and "txt_ids" in text and "img_ids" in text


def test_the_qwen_image_drop_in_refuses_flux_pipeline_arguments_in_one_line():
    """Issue 34, class 6, the reverse: FLUX's ids and pooled projection to Qwen-Image's."""
    model = _dropin(_FakeRunner(QWEN, _qwen_cfg()), QWEN)
    txt, img = _flux_ids(16)
    with pytest.raises(InputError) as info:
        model(torch.zeros(1, 16, 4), torch.zeros(1, 4, 8), pooled_projections=torch.zeros(1, 6),
              timestep=torch.tensor([0.5]), img_ids=img, txt_ids=txt, return_dict=False)
    text = str(info.value)
    assert "\n" not in text
    assert "received pooled_projections, img_ids, txt_ids" in text
    # the families whose pipelines pass them, FLUX's first (others that share them follow)
    assert re.search(r"FLUX\.1 / FLUX\.2[^']*'s pipelines pass", text) and "img_shapes" in text


@pytest.mark.parametrize("pooled", [[[0.0] * 6], [torch.zeros(6)], "pooled", None])
def test_pooled_projections_of_another_type_is_one_line(pooled):
    """Issue 34, class 7: pooled_projections given as a list (or a str) is one line saying
    what arrived and the fix; None is named as missing."""
    model = _dropin(_FakeRunner(FLUX1, _flux_cfg()), FLUX1)
    txt, img = _flux_ids(16)
    with pytest.raises(InputError) as info:
        model(torch.zeros(1, 16, 4), torch.zeros(1, 4, 8), pooled_projections=pooled,
              timestep=torch.tensor([0.5]), img_ids=img, txt_ids=txt,
              guidance=torch.tensor([3.5]), return_dict=False)
    text = str(info.value)
    assert "\n" not in text and "pooled_projections" in text
    assert ("needs pooled_projections" in text) if pooled is None else \
        (f"got a {type(pooled).__name__}" in text and "Fix:" in text)


def test_the_generic_drop_in_builds_the_family_caches():
    """One forward through each family part and the generic path: the caches are the family
    builder's, the conditioning and the mask reach the runner."""
    runner = _FakeRunner(QWEN, _qwen_cfg())
    model = _dropin(runner, QWEN)
    out, = model(torch.zeros(2, 16, 4), torch.zeros(2, 3, 8), torch.ones(2, 3, dtype=torch.int64),
                 0.5, [[(1, 4, 4)]] * 2, return_dict=False)
    want = caches_mod.build_qwen_rope_caches([(1, 4, 4)], 3, axes_dim=(4, 6, 6))
    call = runner.calls[-1]
    assert out.shape == (2, 16, 4) and torch.equal(call["caches"].img, want.img)
    assert call["mask"].dtype == torch.bool and call["timestep"].shape == (2,)
    with pytest.raises(InputError, match="give 16 image tokens but hidden_states has 12"):
        model(torch.zeros(2, 12, 4), torch.zeros(2, 3, 8), None, 0.5, [(1, 4, 4)])


# --------------------------------------------------------------------------------------------
# Ready for what comes next: 5-D latents, per-sample sequences, unrotated streams
# --------------------------------------------------------------------------------------------

def test_a_video_latent_is_patchified_by_the_model():
    video = latents.Latent("video-5d", (1, 2, 2))
    assert video.tokens((2, 16, 5, 8, 12)) == 5 * 4 * 6
    assert video.grid((2, 16, 5, 8, 12)) == (5, 4, 6)
    assert video.shape_for(2, 16, (5, 4, 6)) == (2, 16, 5, 8, 12)
    assert video.grid_axes((5, 4, 6)) == {"latent_frames": 5, "latent_height": 8,
                                          "latent_width": 12}
    with pytest.raises(InputError, match=r"height axis \(7\) is not a whole number of the "
                                         r"model's 2-wide patches"):
        video.tokens((1, 16, 5, 7, 8))
    with pytest.raises(InputError, match=r"must be \[batch, channels, frames, height, width\]"):
        video.tokens((1, 80, 16))
    packed = latents.Latent()
    assert packed.tokens((2, 80, 64)) == 80 and packed.grid((2, 80, 64)) is None
    with pytest.raises(InputError, match="patch size"):
        latents.Latent("video-5d", (1, 0, 2))
    with pytest.raises(InputError, match="latent kind"):
        latents.Latent("video-6d")
    record = SimpleNamespace(latent="video-5d")
    assert latents.latent_of(record, {"patch_size": 2, "patch_size_t": 1}).patch == (1, 2, 2)
    assert latents.latent_of(record, {"patch_size": [1, 2, 2]}).patch == (1, 2, 2)
    assert latents.latent_of(QWEN, {"patch_size": 2}).kind == "packed-tokens"


def test_profiles_carry_a_frames_axis():
    assert profiles.parse_resolutions("832x480x21,512x512") == [(832, 480, 21), (512, 512)]
    assert profiles.image_tokens(832, 480, 21) == 21 * 30 * 52
    video = latents.Latent("video-5d", (1, 2, 2))
    (label, levels), = profiles.preset_axis_levels([(832, 480, 21)], latent=video)
    assert label == "832x480x21" and levels["img_tokens"] == (1, 21 * 30 * 52, 21 * 30 * 52)
    assert levels["latent_frames"] == (1, 21, 21)
    assert levels["latent_height"] == (2, 60, 60) and levels["latent_width"] == (2, 104, 104)
    with pytest.raises(profiles.ProfileError, match="multiples of 32 pixels"):
        profiles.parse_resolutions("528x528", pixels_per_token=32)


def test_per_sample_text_lengths_are_checked_and_masked():
    lengths = latents.TextLengths.checked([3, 1, 4], batch=3, txt_tokens=4)
    assert lengths.padded == 4
    assert lengths.mask().tolist() == [[True] * 3 + [False], [True] + [False] * 3, [True] * 4]
    for bad, match in (([3, 1], "must be 3 whole numbers"), ([3, 0, 4], "got \\[3, 0, 4\\]"),
                       ([3, 5, 4], "got \\[3, 5, 4\\]"), ([3, 1.5, 4], "the entry 1.5"),
                       ("3,1,4", "got str")):
        with pytest.raises(InputError, match=match):
            latents.TextLengths.checked(bad, batch=3, txt_tokens=4)


def test_a_stream_normalised_but_not_rotated_gets_identity_rows():
    txt, img = _flux_ids(16)
    rotated = build_rope_caches("ids", {"txt_ids": txt, "img_ids": img},
                                checked_setting("ids", (4, 6, 6), 10000))
    image_only = build_rope_caches("ids", {"txt_ids": txt, "img_ids": img},
                                   checked_setting("ids", (4, 6, 6), 10000, rotated=("img",)))
    assert torch.equal(image_only.img, rotated.img)
    assert torch.equal(image_only.txt[:, :8], torch.ones(4, 8))
    assert torch.equal(image_only.txt[:, 8:], torch.zeros(4, 8))
    # the rotation by an identity row leaves q exactly (x * 1 - y * 0 = x)
    q = torch.randn(4, 16)
    cos, sin = image_only.txt[:, :8], image_only.txt[:, 8:]
    x, y = q[:, 0::2], q[:, 1::2]
    assert torch.equal(x * cos - y * sin, x) and torch.equal(y * cos + x * sin, y)
    with pytest.raises(InputError, match="rotated must name streams"):
        checked_setting("ids", (4, 6, 6), 10000, rotated=("audio",))


# --------------------------------------------------------------------------------------------
# Schemes by name
# --------------------------------------------------------------------------------------------

def test_schemes_by_name_and_their_fields():
    assert schemes.scheme("grid").FIELDS == ("img_shapes", "txt_seq_len")
    assert schemes.scheme("ids").FIELDS == ("txt_ids", "img_ids")
    with pytest.raises(schemes.BadRequest, match="unknown RoPE position scheme 'polar'"):
        schemes.scheme("polar")
    with pytest.raises(InputError, match="unknown RoPE position scheme"):
        build_rope_caches("polar", {}, checked_setting("ids", (4, 6, 6), 10000))
    for record in (QWEN, FLUX1):
        assert record.scheme in schemes.SCHEMES


# --------------------------------------------------------------------------------------------
# Triton repositories written before the family layout
# --------------------------------------------------------------------------------------------

_OLD = __import__("pathlib").Path(__file__).with_name("fixtures") / "triton_rope_v0"


def _old_rope(name, root):
    """The old qkrope's rope model directory of ``name`` under ``root``: its config.pbtxt and the
    version files, which that qkrope wrote byte-identical for every model (the fixture keeps
    them once, in version_1/: tests/fixtures/make_old_triton_rope.py checks they were equal)."""
    import shutil

    rope = root / f"{name}_rope"
    if not rope.exists():
        shutil.copytree(_OLD / "version_1", rope / "1")
        shutil.copyfile(_OLD / f"{name}_rope" / "config.pbtxt", rope / "config.pbtxt")
    return rope


def _old_rope_requests(pb, name):
    from _triton_helpers import Tensor

    if name == "qwen":
        shapes = np.array([[1, 4, 6], [1, 2, 2]], np.int64)
        return ({"img_shapes": [(1, 4, 6), (1, 2, 2)], "txt_seq_len": 5}, pb.InferenceRequest([
            Tensor("img_shapes", shapes), Tensor("hidden_states", np.zeros((1, 28, 4), np.float32)),
            Tensor("encoder_hidden_states_mask", np.ones((1, 5), bool))]))
    txt = np.stack([np.zeros(5), np.zeros(5), np.zeros(5), np.arange(5)], 1).astype(np.float32)
    img = np.stack([np.zeros(12), np.arange(12) // 4, np.arange(12) % 4, np.zeros(12)],
                   1).astype(np.float32)
    return ({"txt_ids": txt, "img_ids": img}, pb.InferenceRequest([
        Tensor("txt_ids", txt), Tensor("img_ids", img),
        Tensor("hidden_states", np.zeros((1, 12, 4), np.float32)),
        Tensor("encoder_hidden_states", np.zeros((1, 5, 8), np.float32))]))


@pytest.mark.parametrize("name", ["qwen", "flux2"])
def test_an_old_repository_still_serves_the_same_caches(name, tmp_path, monkeypatch):
    """A rope model written by the qkrope before this layout (its own model.py and rope_tables.py,
    tests/fixtures/make_old_triton_rope.py) is self-contained: it keeps serving, and its caches
    are bit-equal to this qkrope's for the same request."""
    pytest.importorskip("tritonclient", reason="requires tritonclient (pip install -e '.[test]')")
    from _triton_helpers import load_rope_model

    from qkrope.runtime.caches import model_setting

    model, pb = load_rope_model(_old_rope(name, tmp_path / "old"), monkeypatch)
    request, triton_request = _old_rope_requests(pb, name)
    resp, = model.execute([triton_request])
    assert resp.error is None, resp.error and resp.error.message()
    record = by_name("flux2" if name == "flux2" else None)
    config = SimpleNamespace(axes_dims_rope=[4, 4, 4, 4] if name == "flux2" else [4, 6, 6],
                             rope_theta=2000 if name == "flux2" else None, diffusers_config={})
    want = build_rope_caches(record.scheme, request, model_setting(config, record))
    for out, cache in (("img_cos_sin_cache", want.img), ("txt_cos_sin_cache", want.txt)):
        assert np.array_equal(pb.get_output_tensor_by_name(resp, out).as_numpy(), cache.numpy())


@pytest.mark.parametrize("name", ["qwen", "flux2"])
def test_an_old_config_with_this_rope_model_serves_or_says_how_to_rewrite(name, tmp_path,
                                                                         monkeypatch):
    """This model.py beside an old config.pbtxt: the ids scheme has every number it needs and
    serves; the grid scheme lacks the table size (a constant of the old model.py) and is
    refused at load in one line that says how to write the repository again."""
    pytest.importorskip("tritonclient", reason="requires tritonclient (pip install -e '.[test]')")
    import shutil

    from _triton_helpers import load_rope_model

    from qkrope.runtime import triton

    rope = tmp_path / f"{name}_rope"
    (rope / "1" / "schemes").mkdir(parents=True)
    shutil.copyfile(_OLD / f"{name}_rope" / "config.pbtxt", rope / "config.pbtxt")
    shutil.copyfile(triton.ROPE_MODEL_TEMPLATE, rope / "1" / "model.py")
    for f in triton.rope_scheme_files():
        shutil.copyfile(f, rope / "1" / "schemes" / f.name)
    if name == "qwen":
        with pytest.raises(ValueError) as info:
            load_rope_model(rope, monkeypatch)
        text = str(info.value)
        assert "\n" not in text and "no max_positions" in text
        assert "qkrope triton-repo ... --force" in text
        return
    model, pb = load_rope_model(rope, monkeypatch)
    _, triton_request = _old_rope_requests(pb, name)
    old, _ = load_rope_model(_old_rope(name, tmp_path / "old"), monkeypatch)
    new_resp, = model.execute([triton_request])
    old_resp, = old.execute([triton_request])
    for out in ("img_cos_sin_cache", "txt_cos_sin_cache"):
        assert np.array_equal(pb.get_output_tensor_by_name(new_resp, out).as_numpy(),
                              pb.get_output_tensor_by_name(old_resp, out).as_numpy())


def test_make_inputs_carries_per_sample_text_lengths_and_an_old_sidecar():
    """make_inputs on a sidecar that names no family (as sidecars written before families were
    recorded): the registry's default family's caches; ``txt_lens`` masks each item's tokens."""
    from _tiny_model import sidecar_dict

    from qkrope.runtime.inputs import make_inputs
    from qkrope.sidecars import ModelInfo

    side = sidecar_dict(batch=3, img=16, txt=5)
    with pytest.raises(InputError, match="is 16 wide but its axes_dims_rope"):
        make_inputs(ModelInfo.from_dict(side))  # no axes: the family's (128 wide) do not fit
    side["config"]["axes_dims_rope"] = [4, 6, 6]
    info = ModelInfo.from_dict(side)
    assert info.config.family is None
    feeds = make_inputs(info, img_shapes=[(1, 4, 4)], txt_len=5, batch=3, txt_lens=[5, 2, 3])
    assert feeds["encoder_hidden_states_mask"].tolist() == [
        [True] * 5, [True, True, False, False, False], [True, True, True, False, False]]
    want = caches_mod.build_qwen_rope_caches([(1, 4, 4)], 5, axes_dim=info.axes_dims_rope())
    assert np.array_equal(feeds["img_cos_sin_cache"], want.img.numpy())
    with pytest.raises(InputError, match="must be 3 whole numbers"):
        make_inputs(info, img_shapes=[(1, 4, 4)], txt_len=5, batch=3, txt_lens=[5, 2])


def test_the_generic_drop_in_checks_a_video_latent_against_its_positions():
    """A family whose latent is 5-D (none is registered yet: a stand-in record of the grid
    scheme): the drop-in patchifies the latent's shape and compares its tokens with the
    position request's."""
    import dataclasses

    from qkrope.families.qwen_image.dropin import QwenImageTransformer

    video = dataclasses.replace(QWEN, latent="video-5d")
    cfg = dict(_qwen_cfg(), patch_size=2, patch_size_t=1)
    runner = _FakeRunner(QWEN, cfg)
    model = QwenImageTransformer(runner, video)
    # [1, C, 2 frames, 8, 8] with 1x2x2 patches: 2 x 4 x 4 = 32 tokens = img_shapes (2, 4, 4)
    model(torch.zeros(1, 4, 2, 8, 8), torch.zeros(1, 3, 8), None, 0.5, [(2, 4, 4)])
    assert runner.calls[-1]["caches"].img.shape[0] == 32
    with pytest.raises(InputError, match=r"gives 16 image tokens but hidden_states \[1, 4, 2, 8, "
                                         r"8\] patchifies into 32"):
        model(torch.zeros(1, 4, 2, 8, 8), torch.zeros(1, 3, 8), None, 0.5, [(1, 4, 4)])
    with pytest.raises(InputError, match="not a whole number of the model's 2-wide patches"):
        model(torch.zeros(1, 4, 2, 8, 7), torch.zeros(1, 3, 8), None, 0.5, [(2, 4, 4)])


def test_table_profile_limits_bound_a_grid_by_the_table_lengths():
    setting = checked_setting("table", (8, 4, 4), 256.0, table_lengths=(256, 32, 32))
    table = schemes.scheme("table")
    assert table.profile_limits(setting, [(1, 32, 32), (1, 2, 2)], 64) is None
    assert table.profile_limits(setting, [(1, 2, 2), (1, 64, 2)], 1) == ("image", 1, 64, 32)
    assert table.profile_limits(setting, [(1, 2, 33)], 1) == ("image", 0, 33, 32)
    unbounded = checked_setting("table", (8, 4, 4), 256.0)
    assert table.profile_limits(unbounded, [(1, 999, 999)], 1) is None


def test_generate_refuses_a_size_past_the_tables_before_any_model_loads(tmp_path, capsys,
                                                                      monkeypatch):
    """`qkrope generate` of a tiny Z-Image (tables [256, 32, 32]) at 32x1024: 64 token rows,
    refused by the preflight (the table scheme's profile limits), nothing loaded."""
    pytest.importorskip("diffusers", reason="requires diffusers (test extras)")
    pytest.importorskip("transformers", reason="the Z-Image pipeline imports transformers")
    import _oneline

    import qkrope.runtime
    from qkrope.apps import tiny_pipeline as tp
    from qkrope.cli import main
    from qkrope.export.api import export_transformer

    tp.save_tiny_pipeline("z-image", tmp_path / "z")
    export_transformer(tmp_path / "z" / "transformer", out=tmp_path / "t.onnx", progress=False)

    def spy(*args, **kwargs):
        raise AssertionError("a model was loaded")
    monkeypatch.setattr(qkrope.runtime, "load_transformer", spy)
    capsys.readouterr()
    assert main(["generate", str(tmp_path / "z"), "--transformer", str(tmp_path / "t.onnx"),
                 "--prompt", "a cat", "--height", "1024", "--width", "32", "--steps", "1",
                 "-o", str(tmp_path / "o.png")]) != 0
    line = _oneline.error_line(capsys)
    assert "needs 64 RoPE positions" in line and "more than the 32" in line, line
    assert not (tmp_path / "o.png").exists()


def _scheme_requests(img_ids, txt_ids):
    """One small request per scheme (scheme module -> request); every scheme has one."""
    out = {schemes.ids: {"txt_ids": txt_ids, "img_ids": img_ids},
           schemes.table: {"txt_ids": txt_ids.astype(np.int64),
                           "img_ids": img_ids.astype(np.int64)},
           schemes.grid: schemes.grid.sample_request([(1, 3, 4)], 5),
           schemes.patch_grid: schemes.patch_grid.sample_request([(1, 3, 4)], 5),
           schemes.scaled_grid: schemes.scaled_grid.sample_request((2, 3, 4)),
           schemes.divided_grid: schemes.divided_grid.sample_request((2, 3, 4), 5),
           schemes.ids_float32: {"txt_ids": txt_ids, "img_ids": img_ids}}
    assert set(out) == set(schemes.SCHEMES.values())
    return out


@pytest.mark.parametrize("zero", [0, 1, 2])
@pytest.mark.parametrize("precision", ["float32", "float64"])
def test_a_zero_width_axis_gives_no_columns_in_every_scheme(zero, precision):
    """A 0-wide RoPE axis (Bria 3.2's [0, 48, 48]) is accepted by checked_setting for every
    scheme, and each scheme's caches are those of the same setting with that axis 4 wide, less
    its columns (its cos and its sin pairs): no NaN, no warning (a 0-wide axis has no
    frequencies). divided_grid's text rows span the whole width (one axis): only their shape
    and finiteness are compared."""
    import warnings

    txt_ids, img_ids = schemes.ids.sample_ids([(1, 3, 4)], 5, n_axes=3, image_step=1)
    thin = [8, 6, 10]
    wide = list(thin)
    thin[zero], wide[zero] = 0, 4
    # the cache is the cos half then the sin half, each axis' dim / 2 pairs in order: the wide
    # setting's columns less the 2 pairs of that axis in each half
    half, start = sum(wide) // 2, sum(wide[:zero]) // 2
    cols = [c for c in range(2 * half) if not start <= c % half < start + 2]
    for module, request in _scheme_requests(img_ids, txt_ids).items():
        name = module.NAME
        extra = dict(max_positions=64, precision=precision, table_lengths=(64, 64, 64)
                     if module is schemes.table else None)
        pairs = []
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            for axes in (thin, wide):
                setting = checked_setting(name, axes, 10000, **extra)
                pairs.append(module.build(module.positions(request, setting), setting))
        got, want = pairs
        for stream, g, w in zip(("img", "txt"), got, want):
            assert g.shape == (w.shape[0], sum(thin)) and np.isfinite(g).all(), (name, stream)
            if not (module is schemes.divided_grid and stream == "txt"):
                assert np.array_equal(g, w[:, cols]), (name, stream)
