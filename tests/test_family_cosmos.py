"""Cosmos-Predict2 (qkrope/families/cosmos): the "scaled_grid" caches against diffusers'
CosmosRotaryPosEmbed, the cache-input wrapper against the stock forward (fp32, bf16, fp16), and
the refusals, on diffusers' own tiny Video2World config (tests/_families.py)."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")

import diffusers.models.transformers.transformer_cosmos as tc  # noqa: E402
from _families import COSMOS_CONFIG, cosmos_torchvision_standin, cosmos_transformer  # noqa: E402,E501

from qkrope.errors import InputError  # noqa: E402
from qkrope.families import cosmos  # noqa: E402
from qkrope.families.cosmos import export as cexport  # noqa: E402
from qkrope.runtime.caches import build_rope_caches, checked_setting  # noqa: E402
from qkrope.runtime.schemes import scaled_grid  # noqa: E402

cosmos_torchvision_standin()  # diffusers resizes the padding mask with torchvision


def _setting(head, scale, max_size):
    cfg = dict(attention_head_dim=head, rope_scale=scale, max_size=max_size, patch_size=(1, 2, 2))
    return checked_setting("scaled_grid", cosmos.rope_axes(head), cosmos.THETA, rotated=("img",),
                           **cosmos.setting_fields(cfg))


def _stock_cache(rope, latent_shape, fps):
    cos, sin = rope(torch.zeros(latent_shape), fps=fps)
    half = cos.shape[1] // 2
    assert torch.equal(cos[:, :half], cos[:, half:]) and torch.equal(sin[:, :half], sin[:, half:])
    return torch.cat([cos[:, :half], sin[:, :half]], 1).contiguous()


# the tiny config, and Predict2's real widths (head 128) with its rope_scale values
CASES = [(16, (2.0, 1.0, 1.0), (4, 32, 32), (3, 8, 8), None),
         (16, (2.0, 1.0, 1.0), (4, 32, 32), (3, 8, 8), 16),
         (128, (1.0, 4.0, 4.0), (128, 240, 240), (1, 44, 80), None),
         (128, (1.0, 3.0, 3.0), (128, 240, 240), (6, 30, 40), 16),
         (128, (2.0, 1.0, 1.0), (128, 240, 240), (6, 30, 40), 10)]


@pytest.mark.parametrize("head,scale,max_size,grid,fps", CASES)
def test_caches_are_diffusers_within_one_ulp(head, scale, max_size, grid, fps):
    """The numpy cache against diffusers' (CPU): the angles are the same float32 products (the
    pow, division and products reproduced), and torch's SLEEF cos/sin differ from the
    correctly rounded values by at most one float32 ulp (scaled_grid's docstring): measured
    here, never more than 1 ulp, on a minority of entries."""
    rope = tc.CosmosRotaryPosEmbed(head, max_size=max_size, patch_size=(1, 2, 2),
                                   rope_scale=scale)
    ref = _stock_cache(rope, (1, 1, grid[0], 2 * grid[1], 2 * grid[2]), fps).numpy()
    img = build_rope_caches("scaled_grid", {"grid": grid, "fps": fps},
                            _setting(head, scale, max_size)).img.numpy()
    assert img.shape == ref.shape == (grid[0] * grid[1] * grid[2], head)
    ulps = np.abs(img.view(np.int32).astype(np.int64) - ref.view(np.int32).astype(np.int64))
    assert ulps.max() <= 1
    assert (ulps > 0).mean() < 0.1


def test_the_frequencies_are_bit_exact():
    """Each axis's inverse frequencies (float32 pow of the float32 base, then 1 / x) are
    diffusers' bits, for the tiny and the real widths and the bases of the configs above."""
    for head, scale, max_size, _, _ in CASES:
        rope = tc.CosmosRotaryPosEmbed(head, max_size=max_size, patch_size=(1, 2, 2),
                                       rope_scale=scale)
        setting = _setting(head, scale, max_size)
        for dim, theta, factor in zip((rope.dim_t, rope.dim_h, rope.dim_w),
                                      setting.axis_thetas,
                                      (rope.t_ntk_factor, rope.h_ntk_factor, rope.w_ntk_factor)):
            assert theta == 10000.0 * factor
            r = torch.arange(0, dim, 2, dtype=torch.float32)[: dim // 2] / dim
            want = (1.0 / (theta ** r)).numpy()
            assert np.array_equal(scaled_grid.frequencies(theta, dim), want)


def _inputs(dtype, batch=2, frames=3, height=8, width=12, txt=7, seed=3):
    g = torch.Generator().manual_seed(seed)
    latent = torch.randn(batch, 16, frames, height, width, generator=g).to(dtype)
    cond = (torch.rand(batch, 1, frames, height, width, generator=g) > 0.5).to(dtype)
    text = torch.randn(batch, txt, COSMOS_CONFIG["text_embed_dim"], generator=g).to(dtype)
    ts = torch.rand(batch, 1, frames, 1, 1, generator=g).to(dtype)
    return latent, cond, text, ts, torch.zeros(1, 1, height, width, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("fps", [None, 16], ids=["image", "video"])
def test_wrapper_is_the_stock_forward_bit_for_bit(dtype, fps):
    """The cache-input wrapper (fused self-attention with rounding 1, interleaved=False) given
    diffusers' own cache equals the stock forward exactly in fp32, bf16 and fp16, with
    Video2World's per-frame timesteps and condition mask, at a grid other than the sample's."""
    stock = cosmos_transformer(0).to(dtype)
    wrapper = cexport.CosmosCacheInputTransformer(cosmos_transformer(0).to(dtype),
                                                  rounding=cosmos.COSMOS_PREDICT2.rounding)
    latent, cond, text, ts, mask = _inputs(dtype)
    with torch.no_grad():
        ref = stock(latent, ts, text, fps=fps, condition_mask=cond, padding_mask=mask,
                    return_dict=False)[0]
        cache = _stock_cache(stock.rope, (1, 1) + tuple(latent.shape[2:]), fps)
        out = wrapper(torch.cat([latent, cond], 1), text, ts.reshape(2, -1).contiguous(), mask,
                      cache)
    assert out.dtype == ref.dtype and torch.equal(out, ref)


def test_wrapper_with_qkrope_caches_is_close_in_fp32():
    """With the numpy caches (within one ulp of diffusers', above) the fp32 output moves by a
    few float32 ulps of the output's scale: each rotated value x*cos - y*sin changes by at most
    |x| ulp(cos) + |y| ulp(sin), about 2^-23 of the normalised |q| ~ 1, which the attention and
    the two blocks carry at the same relative order; the bound is 2^-16 of the output's
    largest value, 128 times that."""
    stock = cosmos_transformer(0)
    wrapper = cexport.CosmosCacheInputTransformer(cosmos_transformer(0), rounding=1)
    latent, cond, text, ts, mask = _inputs(torch.float32)
    setting = cexport.model_setting_of(stock)
    cache = build_rope_caches("scaled_grid", {"grid": (3, 4, 6), "fps": 16}, setting).img
    with torch.no_grad():
        ref = stock(latent, ts, text, fps=16, condition_mask=cond, padding_mask=mask,
                    return_dict=False)[0]
        out = wrapper(torch.cat([latent, cond], 1), text, ts.reshape(2, -1).contiguous(), mask,
                      cache)
    assert (out - ref).abs().max() <= ref.abs().max() * 2.0 ** -16


def test_refusals_are_one_line():
    for overrides, match in ((dict(img_context_dim_in=8), "img_context_dim_in"),
                             (dict(concat_padding_mask=False), "concat_padding_mask")):
        with pytest.raises(InputError, match=match) as e:
            cexport.check_supported(cosmos_transformer(0, **overrides))
        assert "\n" not in str(e.value) and "Fix:" in str(e.value)
    setting = _setting(16, (2.0, 1.0, 1.0), (4, 32, 32))
    for request, match in (({"grid": (17, 4, 4), "fps": None}, "frames positions"),
                           ({"grid": (1, 0, 4), "fps": None}, "at least one token"),
                           ({"grid": (1, 4, 4), "fps": -1}, "fps must be"),
                           ({"grid": (1, 4), "fps": None}, "token grid")):
        with pytest.raises(InputError, match=match) as e:
            build_rope_caches("scaled_grid", request, setting)
        assert "\n" not in str(e.value)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """The tiny model saved and exported (fp32, the default sample: traced with 2 frames)."""
    from qkrope.export.onnx_export import export_transformer

    root = tmp_path_factory.mktemp("cosmos")
    cosmos_transformer(0).save_pretrained(str(root / "tiny"))
    info, _ = export_transformer(root / "m.onnx", root / "tiny", dtype="fp32", progress=False)
    return root / "m.onnx", info


def test_export_graph_and_sidecar(exported):
    """One fused node per block (split halves, rounding 1), the 5-D latent axes by name, no
    text cache, the sidecar's RoPE setting and family."""
    import onnx

    path, info = exported
    model = onnx.load(str(path))
    nodes = [n for n in model.graph.node if n.op_type == "QKNormRoPE"]
    assert len(nodes) == COSMOS_CONFIG["num_layers"]
    for n in nodes:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
        assert attrs["interleaved"] == 0 and attrs["rounding"] == 1
    shapes = {t.name: t.shape for t in info.inputs + info.outputs}
    assert shapes["latent"] == ["batch", 17, "latent_frames", "latent_height", "latent_width"]
    assert shapes["latent_sample"] == ["batch", 16, "latent_frames", "latent_height",
                                       "latent_width"]
    assert "txt_cos_sin_cache" not in shapes
    assert info.config.family == "cosmos-predict2" and info.config.axes_dims_rope == [8, 4, 4]
    assert info.node_attributes.interleaved is False


@pytest.mark.parametrize("batch,frames,height,width,txt,fps",
                         [(1, 1, 6, 10, 5, None), (3, 4, 10, 6, 9, 16)],
                         ids=["image-b1", "video-b3"])
def test_onnxruntime_at_untraced_shapes(exported, batch, frames, height, width, txt, fps):
    """ONNX Runtime on the export, at batches, frame counts, resolutions and text lengths other
    than the traced ones, with qkrope's caches, against the stock forward: fp32 sums in another
    order (ORT's kernels) and caches within one ulp move the output by a few float32 ulps of
    its scale per block (measured 2^-22 relative); the bound is 2^-16 of the largest value."""
    ort = pytest.importorskip("onnxruntime")
    path, _ = exported
    stock = cosmos_transformer(0)
    latent, cond, text, _, mask = _inputs(torch.float32, batch, frames, height, width, txt)
    ts = torch.rand(batch, 1, frames, 1, 1, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        ref = stock(latent, ts, text, fps=fps, condition_mask=cond, padding_mask=mask,
                    return_dict=False)[0].numpy()
    cache = build_rope_caches("scaled_grid", {"grid": (frames, height // 2, width // 2),
                                              "fps": fps}, cexport.model_setting_of(stock)).img
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    out = sess.run(None, {"latent": torch.cat([latent, cond], 1).numpy(),
                          "encoder_hidden_states": text.numpy(),
                          "frame_timestep": ts.reshape(batch, frames).numpy(),
                          "padding_mask": mask.numpy(), "img_cos_sin_cache": cache.numpy()})[0]
    assert out.shape == ref.shape
    assert np.abs(out - ref).max() <= np.abs(ref).max() * 2.0 ** -16


def test_dropin_at_untraced_shapes_and_its_refusals(exported):
    """load_transformer's drop-in takes what the pipelines pass (the 16-channel latent and the
    condition mask, a pixel-size padding mask, [batch] or per-frame timesteps, fps) at a shape
    other than the traced one, within the ONNX Runtime bound above; what the graph cannot take
    is refused in one line."""
    from qkrope.runtime import load_transformer

    path, _ = exported
    stock, dropin = cosmos_transformer(0), load_transformer(path)
    latent, cond, text, ts5, _ = _inputs(torch.float32, 2, 3, 8, 10, 6)
    pixel_mask = torch.zeros(1, 1, 64, 80)
    for ts, fps in ((ts5, 16), (torch.tensor([0.3, 0.6]), None)):
        kw = dict(hidden_states=latent, timestep=ts, encoder_hidden_states=text, fps=fps,
                  condition_mask=cond, padding_mask=pixel_mask, return_dict=False)
        with torch.no_grad():
            ref = stock(**kw)[0]
        out = dropin(**kw)[0]
        assert out.shape == ref.shape
        assert (out - ref).abs().max() <= ref.abs().max() * 2.0 ** -16
    base = dict(hidden_states=latent, timestep=ts5, encoder_hidden_states=text,
                condition_mask=cond, padding_mask=pixel_mask)
    for kw, match in ((dict(attention_mask=torch.ones(2, 6)), "attention_mask"),
                      (dict(block_controlnet_hidden_states=[latent]), "ControlNet"),
                      (dict(condition_mask=None), "16 channels; this model takes 17"),
                      (dict(padding_mask=None), "needs padding_mask"),
                      (dict(padding_mask=torch.zeros(2, 1, 8, 10)), "one mask for the batch"),
                      (dict(encoder_hidden_states=(text, text)), "Predict2.5"),
                      (dict(timestep=torch.rand(2, 1, 2, 1, 1)), "timestep must be"),
                      (dict(img_ids=torch.zeros(4, 3)), "received img_ids")):
        with pytest.raises(InputError, match=match) as e:
            dropin(**{**base, **kw})
        assert "\n" not in str(e.value)


class _NoSafetyChecker:
    """The pipelines' safety checker stood in for (the real one downloads a guardrail)."""

    def __init__(self):
        from diffusers import ConfigMixin, ModelMixin

        class Dummy(ModelMixin, ConfigMixin):
            def __init__(self):
                super().__init__()
                self.p = torch.nn.Parameter(torch.zeros(1))

            def check_text_safety(self, prompt):
                return True

            def check_video_safety(self, frames):
                return frames

        self.module = Dummy()


def _pipeline(cls, transformer):
    from diffusers import AutoencoderKLWan, FlowMatchEulerDiscreteScheduler

    torch.manual_seed(0)  # diffusers' tiny Wan VAE (the Cosmos2 pipeline tests')
    vae = AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                           temperal_downsample=[False, True, True])
    return cls(text_encoder=None, tokenizer=None, transformer=transformer, vae=vae,
               scheduler=FlowMatchEulerDiscreteScheduler(use_karras_sigmas=True),
               safety_checker=_NoSafetyChecker().module)


def test_video_to_world_pipeline_end_to_end(exported):
    """Cosmos2VideoToWorldPipeline (an image, 9 frames at 32x32: latent grid 3 x 2 x 2, not the
    traced 2 x 8 x 8; CFG with a negative prompt; fps 16) on the export, against the same
    pipeline on the PyTorch model: the latents agree within 2^-12 of their scale (the ORT bound
    per call, carried through 2 Euler steps and the guidance sum, each a few operations of the
    same relative order)."""
    import PIL.Image
    from diffusers import Cosmos2VideoToWorldPipeline

    from qkrope.runtime import load_transformer

    path, _ = exported
    g = torch.Generator().manual_seed(0)
    embeds = torch.randn(1, 8, 32, generator=g), torch.randn(1, 8, 32, generator=g)
    outs = []
    for transformer in (cosmos_transformer(0), load_transformer(path)):
        pipe = _pipeline(Cosmos2VideoToWorldPipeline, transformer)
        outs.append(pipe(image=PIL.Image.new("RGB", (32, 32)), prompt_embeds=embeds[0],
                         negative_prompt_embeds=embeds[1], height=32, width=32, num_frames=9,
                         num_inference_steps=2, guidance_scale=3.0, output_type="latent",
                         generator=torch.Generator().manual_seed(1)).frames)
    assert outs[0].shape == outs[1].shape == (1, 16, 3, 4, 4)
    assert (outs[0] - outs[1]).abs().max() <= outs[0].abs().max() * 2.0 ** -12


def test_text_to_image_pipeline_end_to_end(tmp_path):
    """Cosmos2TextToImagePipeline (in_channels 16, no condition mask, [batch] timesteps, no
    fps; 2 images of 48x32, CFG) on an export of the Text2Image form of the tiny model, against
    the PyTorch pipeline, within the bound above."""
    from diffusers import Cosmos2TextToImagePipeline

    from qkrope.export.onnx_export import export_transformer
    from qkrope.runtime import load_transformer

    cosmos_transformer(0, in_channels=16).save_pretrained(str(tmp_path / "t2i"))
    export_transformer(tmp_path / "t2i.onnx", tmp_path / "t2i", dtype="fp32", progress=False)
    g = torch.Generator().manual_seed(0)
    embeds = torch.randn(1, 8, 32, generator=g), torch.randn(1, 8, 32, generator=g)
    outs = []
    for transformer in (cosmos_transformer(0, in_channels=16),
                        load_transformer(tmp_path / "t2i.onnx")):
        pipe = _pipeline(Cosmos2TextToImagePipeline, transformer)
        outs.append(pipe(prompt_embeds=embeds[0], negative_prompt_embeds=embeds[1], height=48,
                         width=32, num_images_per_prompt=2, num_inference_steps=2,
                         guidance_scale=3.0, output_type="latent",
                         generator=torch.Generator().manual_seed(1)).images)
    assert outs[0].shape == outs[1].shape
    assert (outs[0] - outs[1]).abs().max() <= outs[0].abs().max() * 2.0 ** -12


def test_qkrope_check_passes_against_diffusers_forward(exported, capsys):
    """``qkrope check`` on the export: make_inputs' latent, per-frame timesteps and padding mask
    with the scheme's caches, through ONNX Runtime, against diffusers' own forward (its RoPE
    from the latent's shape): PASSED, one output compared."""
    from qkrope.cli import main

    path, _ = exported
    assert main(["check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "latent_sample" in out and "PASSED" in out


def test_build_profiles_have_the_frames_axis(exported):
    """``qkrope build --resolutions WxHxFRAMES``: one profile per video preset over the latent's
    frames, height and width (min one patch), the per-frame timesteps, the padding mask and the
    cache rows of the preset's token grid; a preset past the model's RoPE table is refused."""
    from qkrope.runtime import profiles
    from qkrope.sidecars import ModelInfo

    path, _ = exported
    info = ModelInfo.load(str(path))
    presets = profiles.parse_resolutions("64x64x2,128x96x3", pixels_per_token=16)
    (small, p1), (large, p2) = profiles.derive_preset_profiles(info, presets)
    assert (small, large) == ("64x64x2", "128x96x3")
    assert p2["latent"]["max"] == (2, 17, 3, 12, 16) and p2["latent"]["min"] == (1, 17, 1, 2, 2)
    assert p2["frame_timestep"]["max"] == (2, 3)
    assert p2["padding_mask"]["max"] == (1, 1, 12, 16)
    assert p2["img_cos_sin_cache"]["max"] == (3 * 6 * 8, 16)
    with pytest.raises(profiles.ProfileError, match="RoPE positions"):
        profiles.derive_preset_profiles(info, profiles.parse_resolutions("4096x4096x2"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
def test_wrapper_with_a_batch_timestep(dtype):
    """Text2Image's ``[batch]`` timestep (the wrapper takes it repeated over the frames):
    bit-exact in bf16 and fp16; in fp32 diffusers' AdaLN projections run on ``[batch, dim]``
    rows there and on every token's row here (the per-frame path's form), which float32 GEMMs
    round differently in the last bits: measured 2^-22 of the output's scale, bounded by
    2^-16 as above."""
    stock = cosmos_transformer(0, in_channels=16).to(dtype)
    wrapper = cexport.CosmosCacheInputTransformer(
        cosmos_transformer(0, in_channels=16).to(dtype), rounding=1)
    latent, _, text, _, mask = _inputs(dtype, 2, 1, 8, 12)
    ts = torch.tensor([0.3, 0.7]).to(dtype)
    with torch.no_grad():
        ref = stock(latent, ts, text, padding_mask=mask, return_dict=False)[0]
        cache = _stock_cache(stock.rope, (1, 1) + tuple(latent.shape[2:]), None)
        out = wrapper(latent, text, ts.reshape(2, 1).contiguous(), mask, cache)
    if dtype == torch.float32:
        assert (out - ref).abs().max() <= ref.abs().max() * 2.0 ** -16
    else:
        assert torch.equal(out, ref)
