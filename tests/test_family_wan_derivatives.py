"""Wan's derivatives on the wan folder's hooks (qkrope/families/wan: one Derivative table, no
copied functions): SkyReels-V2 (SkyReelsV2Transformer3DModel: a float64 timestep sinusoid, the
diffusion-forcing arguments), ChronoEdit (ChronoEditTransformer3DModel: Wan 2.1 I2V's
image branch, a two-frame latent's frames at positions 0 and 7) and Wan-VACE
(WanVACETransformer3DModel: a control latent through control blocks whose scaled hints are
added after the blocks vace_layers names). Each: its tiny model (the
family's tiny.py) exported in fp32, the drop-in at untraced shapes against diffusers' forward
in float64 within the Wan tests' bound, its pipeline end to end, its refusals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("onnxruntime")

from test_family_wan import (GUIDANCE, STEPS, _pipeline_bound,  # noqa: E402
                             _stock_ort_error)

from qkrope.errors import InputError  # noqa: E402
from qkrope.families.wan import CHRONOEDIT, SKYREELS_V2, WAN_VACE, wan_axes  # noqa: E402
from qkrope.families.wan import tiny  # noqa: E402

SKY, CHRONO, VACE = SKYREELS_V2.class_name, CHRONOEDIT.class_name, WAN_VACE.class_name
TEXT = 512  # ChronoEdit's I2V attention reads its image tokens with 512 text tokens


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """Each class's tiny model (seed 0) exported in fp32 at a (2, 4, 6) grid, batch 2."""
    from qkrope.export.onnx_export import export_transformer

    root = tmp_path_factory.mktemp("wan-derivatives")
    out = {}
    for cls in (SKY, CHRONO):
        folder, path = root / cls, root / f"{cls}.onnx"
        tiny.wan_transformer(0, cls).save_pretrained(str(folder))
        export_transformer(path, folder, img_shapes=[(2, 4, 6)], txt_len=7, batch=2,
                           progress=False)
        out[cls] = (folder, path)
    return out


def _stock(cls, folder):
    return getattr(diffusers, cls).from_pretrained(str(folder)).eval()


def _call(cls, seed, frames, batch, text_tokens=11):
    """A call's latent, text, timestep (and ChronoEdit's CLIP tokens: 9, untraced)."""
    cfg = tiny.CONFIGS[cls]
    g = torch.Generator().manual_seed(seed)
    latent = torch.randn(batch, cfg["in_channels"], frames, 10, 6, generator=g)
    text = torch.randn(batch, TEXT if cfg.get("image_dim") else text_tokens, 16, generator=g)
    t = torch.rand(batch, generator=g) * 999
    image = torch.randn(batch, 9, 4, generator=g) if cfg.get("image_dim") else None
    return latent, t, text, image


def _errors(cls, folder, dropin, latent, t, text, image, **extra):
    """(the drop-in's error, diffusers' own ONNX export's error) against diffusers' forward in
    float64 at this call (the Wan tests' bound: test_ort_dropin_at_untraced_shapes)."""
    stock = _stock(cls, folder)
    rest = () if image is None else (image,)
    with torch.no_grad():
        ref64 = stock.double()(latent.double(), t.double(), text.double(),
                               *(r.double() for r in rest), return_dict=False)[0]
    stock.float()
    out = dropin(latent, t, text, *rest, return_dict=False, **extra)[0]
    assert out.shape == ref64.shape and out.dtype == torch.float32
    return (float((out.double() - ref64).abs().max()),
            _stock_ort_error(stock, latent, t, text, ref64, image))


# --------------------------------------------------------------------------------------------
# What differs from Wan
# --------------------------------------------------------------------------------------------

def test_skyreels_sinusoid_within_two_float32_ulps_of_float64():
    """SinCos64 (float32 only) against diffusers' float64 get_1d_sincos_pos_embed_from_grid:
    within 2 ulps of 1 (the float64 value rounded once, plus float32 sin / cos of the rounded
    angle, corrected by the carried error to first order); the plain float32 angle misses by
    orders of magnitude (why the correction is there)."""
    from diffusers.models.embeddings import get_1d_sincos_pos_embed_from_grid

    from qkrope.families.wan.export import SinCos64

    t = torch.cat([torch.tensor([999.0, 0.0, 1.0, 500.0]),
                   torch.rand(64, generator=torch.Generator().manual_seed(0)) * 1000])
    want = get_1d_sincos_pos_embed_from_grid(256, t, flip_sin_to_cos=True).float()
    module = SinCos64(256)
    bound = 2.0 ** -23
    assert float((module(t) - want).abs().max()) <= bound
    plain = torch.cat([torch.cos(t[:, None] * module.hi), torch.sin(t[:, None] * module.hi)], 1)
    assert float((plain - want).abs().max()) > 100 * bound


@pytest.mark.parametrize("frames", [2, 3])
def test_chronoedit_caches_are_diffusers_bit_for_bit(frames):
    """ChronoEdit's caches (the ids scheme from reference.position_request) equal diffusers'
    ChronoEditRotaryPosEmbed bit for bit at head_dim 128: a two-frame latent at frame
    positions 0 and 7, three frames at 0, 1, 2."""
    from qkrope.families.wan.reference import position_request
    from qkrope.runtime.caches import build_rope_caches, checked_setting

    rope = diffusers.models.transformers.transformer_chronoedit.ChronoEditRotaryPosEmbed(
        128, (1, 2, 2), 32)
    cos, sin = rope(torch.zeros(1, 4, frames, 8, 6))
    setting = checked_setting("ids", wan_axes(128), 10000, max_positions=32, scale_rope=False,
                              rotated=("img",), precision="float64")
    img = build_rope_caches("ids", position_request(CHRONOEDIT, {}, [(frames, 4, 3)], 5),
                            setting).img
    assert torch.equal(img[:, :64], cos[0, :, 0, ::2].float())
    assert torch.equal(img[:, 64:], sin[0, :, 0, ::2].float())


# --------------------------------------------------------------------------------------------
# Export and drop-in
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cls,frames", [(SKY, 3), (CHRONO, 2), (CHRONO, 3)])
def test_ort_dropin_at_untraced_shapes(exported, cls, frames):
    """The drop-in at a grid, batch and text length the export never traced (ChronoEdit: its
    two-frame edit and three frames): <= 2 x the error of diffusers' own model exported by
    torch.onnx and run by ONNX Runtime (the Wan tests' bound; SkyReels-V2's sinusoid is within
    2 float32 ulps of the float64 one its reference computes: test above)."""
    from qkrope.runtime import load_transformer

    folder, path = exported[cls]
    ours, stock = _errors(cls, folder, load_transformer(path), *_call(cls, 5, frames, 3))
    assert 0 < stock and ours <= 2 * stock, (ours, stock)


def test_skyreels_diffusion_forcing_call(exported):
    """SkyReels-V2's diffusion-forcing call ([batch, frames] timesteps, equal within a sample:
    the synchronous schedule; fps ignored as diffusers ignores it without inject_sample_info)
    gives the [batch] call's result; frames of different timesteps, and a causal block of 5,
    are refused in one line."""
    from qkrope.runtime import load_transformer

    folder, path = exported[SKY]
    dropin = load_transformer(path)
    latent, t, text, _ = _call(SKY, 6, 3, 2)
    base = dropin(latent, t, text, return_dict=False)[0]
    frames = t[:, None].expand(2, 3).contiguous()
    df = dropin(hidden_states=latent, timestep=frames, encoder_hidden_states=text,
                enable_diffusion_forcing=True, fps=[1, 1], return_dict=False)[0]
    assert torch.equal(df, base)
    frames[0, 1] += 1
    with pytest.raises(InputError, match="different timesteps to the frames") as err:
        dropin(hidden_states=latent, timestep=frames, encoder_hidden_states=text,
               enable_diffusion_forcing=True)
    assert "\n" not in str(err.value)
    dropin._set_ar_attention(1)
    with pytest.raises(InputError, match="causal_block_size 5"):
        dropin._set_ar_attention(5)


@pytest.mark.parametrize("cls,change,match", [
    (SKY, dict(inject_sample_info=True), "inject_sample_info true; the SkyReels-V2 export"),
    (SKY, dict(num_frame_per_block=2), "num_frame_per_block 2"),
    (CHRONO, dict(attention_head_dim=16, num_attention_heads=2, added_kv_proj_dim=32),
     "splits them at 5"),
    (CHRONO, dict(rope_temporal_skip_len=4), "rope_temporal_skip_len 4"),
])
def test_export_refusals(tmp_path, cls, change, match):
    """What the export cannot reproduce is refused in one line before any work."""
    from qkrope.export.onnx_export import export_transformer

    folder = tmp_path / "m"
    tiny.wan_transformer(0, cls, **change).save_pretrained(str(folder))
    with pytest.raises(InputError, match=match) as err:
        export_transformer(tmp_path / "m.onnx", folder, img_shapes=[(2, 4, 6)], txt_len=7,
                           progress=False)
    assert "\n" not in str(err.value) and not (tmp_path / "m.onnx").exists()


# --------------------------------------------------------------------------------------------
# The pipelines
# --------------------------------------------------------------------------------------------

def _per_call(cls, folder, frames, hw, image=None) -> float:
    """One call's allowed difference at the pipelines' size (the Wan pipeline tests'):
    torch's fp32 error vs float64 plus 2 x ONNX Runtime's on diffusers' own export."""
    stock = _stock(cls, folder)
    latent, t, text, clip = _call(cls, 7, frames, 1)
    latent = latent[..., :hw[0], :hw[1]]
    clip = image if image is not None else clip
    rest = () if clip is None else (clip,)
    with torch.no_grad():
        ref32 = stock(latent, t, text, *rest, return_dict=False)[0]
        ref64 = stock.double()(latent.double(), t.double(), text.double(),
                               *(r.double() for r in rest), return_dict=False)[0]
    stock.float()
    e32 = float((ref32.double() - ref64).abs().max())
    return e32 + 2 * _stock_ort_error(stock, latent, t, text, ref64, clip)


@pytest.mark.parametrize("pipeline", ["SkyReelsV2Pipeline",
                                      "SkyReelsV2DiffusionForcingPipeline"])
def test_skyreels_pipelines(exported, pipeline):
    """SkyReelsV2Pipeline and its diffusion-forcing pipeline (synchronous, causal_block_size
    1; a 9-frame 48x32 video: grid (3, 3, 2), untraced), true CFG, on the export against the
    same pipeline on diffusers' model, within the Wan pipeline tests' bound."""
    from qkrope.runtime import load_transformer

    folder, path = exported[SKY]
    cls = getattr(diffusers, pipeline)

    def run(transformer):
        scheduler = diffusers.UniPCMultistepScheduler(flow_shift=8.0, use_flow_sigmas=True,
                                                      prediction_type="flow_prediction")
        pipe = cls(tokenizer=None, text_encoder=None, vae=None, scheduler=scheduler,
                   transformer=transformer)
        pipe.set_progress_bar_config(disable=True)
        g = torch.Generator().manual_seed(0)
        kwargs = dict(prompt_embeds=torch.randn(1, 11, 16, generator=g),
                      negative_prompt_embeds=torch.randn(1, 11, 16, generator=g), height=48,
                      width=32, num_frames=9, num_inference_steps=STEPS,
                      guidance_scale=GUIDANCE, output_type="latent",
                      generator=torch.Generator().manual_seed(1))
        if "Forcing" in pipeline:
            kwargs.update(prompt=None, causal_block_size=1, ar_step=0)
        return pipe(**kwargs).frames

    want = run(_stock(SKY, folder))
    got = run(load_transformer(path))
    assert got.shape == want.shape and got.shape[-3:] == (3, 6, 4)
    assert float((got - want).abs().max()) <= _pipeline_bound(_per_call(SKY, folder, 3, (6, 4)))


def test_chronoedit_pipeline(exported):
    """ChronoEditPipeline's edit (5 frames: a two-latent-frame video at frame positions 0 and
    7, 32x48, untraced), the CLIP tokens of a tiny CLIPVisionModel and the image latent of
    diffusers' tiny AutoencoderKLWan built in code, 512-token prompt embeddings, true CFG, on
    the export against the same pipeline on diffusers' model, within the Wan pipeline tests'
    bound (a per-call difference measured at this call's sizes)."""
    import PIL.Image
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    from qkrope.runtime import load_transformer

    folder, path = exported[CHRONO]
    torch.manual_seed(0)
    vae = tiny.vae(16)
    encoder = CLIPVisionModel(CLIPVisionConfig(
        hidden_size=4, num_hidden_layers=2, num_attention_heads=2, image_size=32,
        intermediate_size=16, patch_size=8)).eval()
    processor = CLIPImageProcessor(crop_size=32, size=32)
    image = PIL.Image.fromarray((np.random.RandomState(0).rand(32, 48, 3) * 255).astype("uint8"))
    seen = []

    def run(transformer):
        pipe = diffusers.ChronoEditPipeline(
            tokenizer=None, text_encoder=None, vae=vae, image_processor=processor,
            image_encoder=encoder, transformer=transformer,
            scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0))
        pipe.set_progress_bar_config(disable=True)
        forward = transformer.forward

        def counted(*a, **k):
            seen.append(tuple(k["hidden_states"].shape))
            return forward(*a, **k)

        transformer.forward = counted
        g = torch.Generator().manual_seed(0)
        return pipe(image=image, prompt_embeds=torch.randn(1, TEXT, 16, generator=g),
                    negative_prompt_embeds=torch.randn(1, TEXT, 16, generator=g), height=32,
                    width=48, num_inference_steps=STEPS, guidance_scale=GUIDANCE,
                    output_type="latent", generator=torch.Generator().manual_seed(1)).frames

    want = run(_stock(CHRONO, folder))
    got = run(load_transformer(path))
    assert got.shape == want.shape == (1, 16, 2, 4, 6)
    assert set(seen) == {(1, 36, 2, 4, 6)}
    g = torch.Generator().manual_seed(9)
    clip = torch.randn(1, 17, 4, generator=g)
    assert float((got - want).abs().max()) <= _pipeline_bound(
        _per_call(CHRONO, folder, 2, (4, 6), clip))


# --------------------------------------------------------------------------------------------
# Wan-VACE
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def vace(tmp_path_factory):
    """Wan-VACE's tiny model (seed 0: 3 blocks, hints after blocks 0 and 2, a 72-channel
    control latent) exported in fp32 at a (2, 4, 6) grid, batch 2."""
    from qkrope.export.onnx_export import export_transformer

    root = tmp_path_factory.mktemp("wan-vace")
    folder, path = root / VACE, root / f"{VACE}.onnx"
    tiny.wan_transformer(0, VACE).save_pretrained(str(folder))
    export_transformer(path, folder, img_shapes=[(2, 4, 6)], txt_len=7, batch=2,
                       progress=False)
    return folder, path


def _control(seed, latent):
    """A control latent of ``latent``'s batch and grid, and one scale per control block."""
    g = torch.Generator().manual_seed(seed)
    b, _, f, h, w = latent.shape
    channels = tiny.CONFIGS[VACE]["vace_in_channels"]
    return (torch.randn(b, channels, f, h, w, generator=g),
            0.5 + torch.rand(len(tiny.CONFIGS[VACE]["vace_layers"]), generator=g))


def _vace_errors(folder, dropin, latent, t, text, control, scale):
    """(the drop-in's error, diffusers' own ONNX export's error) against diffusers' forward in
    float64 at this call."""
    stock = _stock(VACE, folder)
    with torch.no_grad():
        ref64 = stock.double()(latent.double(), t.double(), text.double(),
                               control_hidden_states=control.double(),
                               control_hidden_states_scale=scale.double(),
                               return_dict=False)[0]
    stock.float()
    out = dropin(latent, t, text, None, control, scale, return_dict=False)[0]
    assert out.shape == ref64.shape and out.dtype == torch.float32
    return (float((out.double() - ref64).abs().max()),
            _stock_ort_error(stock, latent, t, text, ref64, control_hidden_states=control,
                             control_hidden_states_scale=scale))


def test_vace_graph_and_ort_dropin_at_untraced_shapes(vace):
    """The graph: Wan's inputs, the control patches on the latent's token axis and the
    scales (roles the runner passes), one fused node per block and per control block; the
    drop-in at a grid, batch and text length the export never traced within the Wan tests'
    bound (<= 2 x ONNX Runtime's error on diffusers' own export)."""
    import onnx

    from qkrope.runtime import load_transformer
    from qkrope.sidecars import ModelInfo

    folder, path = vace
    graph = onnx.load(str(path), load_external_data=False).graph
    assert [i.name for i in graph.input][-2:] == ["control_hidden_states",
                                                  "control_hidden_states_scale"]
    assert sum(n.op_type == "QKNormRoPE" for n in graph.node) == 3 + 2
    info = ModelInfo.load(path)
    assert info.role_of("control_hidden_states") == "control_hidden_states"
    assert info.role_of("control_hidden_states_scale") == "control_hidden_states_scale"
    latent, t, text, _ = _call(VACE, 5, 3, 3)
    ours, stock = _vace_errors(folder, load_transformer(path), latent, t, text,
                               *_control(6, latent))
    assert 0 < stock and ours <= 2 * stock, (ours, stock)


def test_vace_call_forms_and_refusals(vace):
    """WanVACEPipeline's forms: scales None (ones, as diffusers) and a number for every block
    give the tensor's result; a control latent missing, of another grid or channel count, and
    scales of another count are refused in one line."""
    from qkrope.runtime import load_transformer

    folder, path = vace
    dropin = load_transformer(path)
    latent, t, text, _ = _call(VACE, 7, 2, 1)
    control, _ = _control(8, latent)
    kw = dict(hidden_states=latent, timestep=t, encoder_hidden_states=text,
              control_hidden_states=control, return_dict=False)
    ones = dropin(**kw, control_hidden_states_scale=torch.ones(2))[0]
    assert torch.equal(dropin(**kw)[0], ones)
    assert torch.equal(dropin(**kw, control_hidden_states_scale=1.0)[0], ones)
    assert not torch.equal(dropin(**kw, control_hidden_states_scale=0.5)[0], ones)
    for change, match in ((dict(control_hidden_states=None), "needs control_hidden_states"),
                          (dict(control_hidden_states=control[..., :4]), "latent's size"),
                          (dict(control_hidden_states=control[:, :8]), "72 channels"),
                          (dict(control_hidden_states_scale=torch.ones(3)), r"must be \[2\]")):
        with pytest.raises(InputError, match=match) as err:
            dropin(**{**kw, **change})
        assert "\n" not in str(err.value)


@pytest.mark.parametrize("change,match", [
    (dict(vace_layers=[0, 0]), "vace_layers \\[0, 0\\]; the control blocks need distinct"),
    (dict(image_dim=4), "image_dim 4 with vace_layers"),
])
def test_vace_export_refusals(tmp_path, change, match):
    """A control branch the export cannot reproduce is refused in one line before any work
    (the config.json edited: diffusers builds duplicate layers and a CLIP embedder fine)."""
    import json

    from qkrope.export.onnx_export import export_transformer

    folder = tmp_path / "m"
    tiny.wan_transformer(0, VACE).save_pretrained(str(folder))
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(InputError, match=match) as err:
        export_transformer(tmp_path / "m.onnx", folder, img_shapes=[(2, 4, 6)], txt_len=7,
                           progress=False)
    assert "\n" not in str(err.value) and not (tmp_path / "m.onnx").exists()


@pytest.mark.slow
def test_vace_pipeline(vace):
    """WanVACEPipeline (a 9-frame 48x32 video with a mask and one reference image: a
    (4, 3, 2) latent grid, untraced; per-block conditioning scales; true CFG) with the tiny
    AutoencoderKLWan built in code, on the export against the same pipeline on diffusers'
    model, within the Wan pipeline tests' bound (a per-call difference measured at this call's
    sizes)."""
    import PIL.Image

    from qkrope.runtime import load_transformer

    folder, path = vace
    rng = np.random.RandomState(0)
    video = [PIL.Image.fromarray((rng.rand(48, 32, 3) * 255).astype("uint8")) for _ in range(9)]
    mask = [PIL.Image.fromarray(((rng.rand(48, 32) > 0.5) * 255).astype("uint8"))
            for _ in range(9)]
    reference = PIL.Image.fromarray((rng.rand(48, 32, 3) * 255).astype("uint8"))
    vae = tiny.vae(4)
    seen = []

    def run(transformer):
        pipe = diffusers.WanVACEPipeline(
            tokenizer=None, text_encoder=None, vae=vae, transformer=transformer,
            scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0))
        pipe.set_progress_bar_config(disable=True)
        forward = transformer.forward

        def counted(*a, **k):
            seen.append((tuple(k["hidden_states"].shape),
                         tuple(k["control_hidden_states"].shape)))
            return forward(*a, **k)

        transformer.forward = counted
        g = torch.Generator().manual_seed(0)
        return pipe(video=video, mask=mask, reference_images=[reference],
                    conditioning_scale=[0.8, 1.2],
                    prompt_embeds=torch.randn(1, 11, 16, generator=g),
                    negative_prompt_embeds=torch.randn(1, 11, 16, generator=g), height=48,
                    width=32, num_frames=9, num_inference_steps=STEPS,
                    guidance_scale=GUIDANCE, output_type="latent",
                    generator=torch.Generator().manual_seed(1)).frames

    want = run(_stock(VACE, folder))
    got = run(load_transformer(path))
    assert got.shape == want.shape == (1, 4, 4, 6, 4)
    assert set(seen) == {((1, 4, 4, 6, 4), (1, 72, 4, 6, 4))}
    stock = _stock(VACE, folder)
    latent, t, text, _ = _call(VACE, 9, 4, 1)
    latent = latent[..., :6, :4]
    control, _ = _control(10, latent)
    scale = torch.tensor([0.8, 1.2])
    kw = dict(control_hidden_states=control, control_hidden_states_scale=scale,
              return_dict=False)
    with torch.no_grad():
        ref32 = stock(latent, t, text, **kw)[0]
        ref64 = stock.double()(latent.double(), t.double(), text.double(),
                               control_hidden_states=control.double(),
                               control_hidden_states_scale=scale.double(),
                               return_dict=False)[0]
    stock.float()
    per_call = float((ref32.double() - ref64).abs().max()) + 2 * _stock_ort_error(
        stock, latent, t, text, ref64, control_hidden_states=control,
        control_hidden_states_scale=scale)
    assert float((got - want).abs().max()) <= _pipeline_bound(per_call)
