"""Z-Image (diffusers' ZImageTransformer2DModel) on the family folder qkrope/families/z_image:

- the caches ("table" scheme) bit-equal to every row of diffusers' RopeEmbedder tables;
- the cache-input wrapper (one QKNormRoPE call per attention) bit-exact with the stock forward
  in fp32, and in bf16 / fp16 with rounding 1 (diffusers' RMSNorm then a complex64 rotation:
  Qwen-Image's order), on lists of samples whose captions and images need padding;
- the export through ONNX Runtime at untraced shapes, batch sizes and caption lengths (samples
  of different caption lengths in one call: the drop-in's groups);
- diffusers' ZImagePipeline, ZImageImg2ImgPipeline and ZImageInpaintPipeline end to end on the
  export (true CFG with a shorter negative prompt);
- the refusals, one line each.

Tiny model: diffusers' own test config (tests/_families.py).
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

diffusers = pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")

from _families import BUILDERS, Z_IMAGE_CONFIG  # noqa: E402

from qkrope.errors import InputError  # noqa: E402
from qkrope.families.z_image import Z_IMAGE  # noqa: E402
from qkrope.families.z_image.dropin import (ZImageTransformer, caches_for_sizes,  # noqa: E402
                                            padded)
from qkrope.families.z_image.export import ZImageCacheInputTransformer  # noqa: E402

BUILDER = BUILDERS["z-image"]
AXES = tuple(Z_IMAGE_CONFIG["axes_dims"])
THETA = Z_IMAGE_CONFIG["rope_theta"]
#: The export's per-call error through ONNX Runtime, relative to max|output|. Z-Image's
#: timestep embedding takes sin/cos of t * 1000 * exp(-k ln(10^4) / 128) in float32: a
#: one-ulp difference between two libraries' exp (2^-24 relative) moves an argument of up to
#: 1000 rad by 6e-5 rad, and the AdaLN modulations carry that into every block's scale and gate
#: (measured here: 2e-5 .. 6e-5 of max|output|, the order of FLUX's stock export, 6.8e-5 and
#: 1.4e-4). The bound is FLUX's: twice the largest, rounded up.
Z_IMAGE_PARITY = 5e-4


def _stock(dtype=torch.float32):
    return BUILDER.build(0).to(dtype)


def _patchify(images, p=2):
    """diffusers' _patchify_image of [C, 1, H, W] latents, stacked: [B, N, 4C]."""
    x = torch.stack(images)
    b, c, f, h, w = x.shape
    x = x.view(b, c, f, 1, h // p, p, w // p, p).permute(0, 2, 4, 6, 3, 5, 7, 1)
    return x.reshape(b, f * (h // p) * (w // p), p * p * c)


def _unpatchify(out, shape, p=2):
    c, f, h, w = shape
    b = out.shape[0]
    out = out.view(b, f, h // p, w // p, 1, p, p, c).permute(0, 7, 1, 4, 2, 5, 3, 6)
    return list(out.reshape(b, c, f, h, w).unbind(0))


def _samples(h, w, lengths, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = [torch.randn(16, 1, h, w, generator=g).to(dtype) for _ in lengths]
    caps = [torch.randn(n, 16, generator=g).to(dtype) for n in lengths]
    t = torch.rand(len(lengths), generator=g)
    return x, caps, t


# --------------------------------------------------------------------------------------------
# The caches
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("config", [dict(axes_dims=[32, 48, 48], axes_lens=[1024, 512, 512],
                                          rope_theta=256.0),
                                     {k: Z_IMAGE_CONFIG[k] for k in
                                      ("axes_dims", "axes_lens", "rope_theta")}],
                         ids=["real", "tiny"])
def test_the_tables_are_diffusers_bit_for_bit(config):
    """Every row of every axis table of diffusers' RopeEmbedder (float64 frequencies, float32
    angles, complex64 polar), as cache columns: equal bits."""
    from diffusers.models.transformers.transformer_z_image import RopeEmbedder

    from qkrope.runtime.schemes import BIT_EXACT, table

    if not BIT_EXACT:
        pytest.skip("no C maths library could be loaded: the tables are within one ulp only")
    tables = RopeEmbedder.precompute_freqs_cis(config["axes_dims"], config["axes_lens"],
                                               config["rope_theta"])
    for dim, length, freqs in zip(config["axes_dims"], config["axes_lens"], tables):
        ours = table.cache(np.arange(length, dtype=np.int64)[:, None], axes_dim=(dim,),
                           theta=config["rope_theta"])
        theirs = torch.cat([freqs.real, freqs.imag], -1).numpy()
        assert ours.shape == theirs.shape == (length, dim)
        assert np.array_equal(ours.view(np.int32), theirs.view(np.int32))


def test_the_caches_are_the_pipelines_positions():
    """Caption token j at (1 + j, 0, 0), image token (y, x) at (S + 1, y, x) with S the padded
    caption length: the rows diffusers' patchify_and_embed gives those tokens."""
    from diffusers.models.transformers.transformer_z_image import RopeEmbedder

    emb = RopeEmbedder(theta=THETA, axes_dims=list(AXES), axes_lens=[256, 32, 32])
    s, h, w = 64, 3, 5
    caches = caches_for_sizes([(1, h, w)], s, axes=AXES, theta=THETA)
    txt_ids = torch.stack([torch.arange(1, s + 1), torch.zeros(s, dtype=torch.long),
                           torch.zeros(s, dtype=torch.long)], 1)
    y, x = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    img_ids = torch.stack([torch.full((h * w,), s + 1), y.ravel(), x.ravel()], 1)
    for cache, ids in ((caches.txt, txt_ids), (caches.img, img_ids)):
        f = emb(ids)
        assert torch.equal(cache, torch.cat([f.real, f.imag], -1))


def test_table_ids_are_refused_in_one_line():
    from qkrope.runtime.caches import build_rope_caches, checked_setting

    setting = checked_setting("table", AXES, THETA)
    good = np.zeros((4, 3), np.int64)
    for bad, match in ((np.full((4, 3), 1.5), "whole positions"),
                       (np.full((4, 3), -1), "whole positions"),
                       (np.zeros((4, 2)), "3 RoPE axes"),
                       (np.zeros((0, 3)), "at least one token")):
        with pytest.raises(InputError, match=match) as e:
            build_rope_caches("table", {"txt_ids": good, "img_ids": bad}, setting)
        assert "\n" not in str(e.value)


def test_the_triton_rope_request_gives_the_same_caches():
    """The rope model's part of the scheme (numpy only: what the Triton Python backend runs):
    the ids of a request checked against its tensors' token counts, the same caches."""
    from qkrope.runtime.caches import checked_setting
    from qkrope.runtime.schemes import BadRequest, table

    from qkrope.families.z_image.dropin import sample_ids

    setting = checked_setting("table", AXES, THETA)
    assert [n for n, _, _ in table.triton_inputs(setting)] == ["txt_ids", "img_ids"]
    txt, img = sample_ids([(1, 3, 5)], 64)
    names = {"latent": "hidden_states", "txt": "encoder_hidden_states_mask"}
    pos = table.triton_positions({"txt_ids": txt, "img_ids": img},
                                 {"latent": (2, 15, 64), "txt": (2, 64)}, names, setting,
                                 max_img=4096, max_txt=512)
    want = caches_for_sizes([(1, 3, 5)], 64, axes=AXES, theta=THETA)
    img_cache, txt_cache = table.build(pos, setting)
    assert np.array_equal(img_cache, want.img.numpy())
    assert np.array_equal(txt_cache, want.txt.numpy())
    with pytest.raises(BadRequest, match="one per token"):
        table.triton_positions({"txt_ids": txt, "img_ids": img},
                               {"latent": (2, 16, 64), "txt": (2, 64)}, names, setting,
                               max_img=4096, max_txt=512)


# --------------------------------------------------------------------------------------------
# The wrapper against the stock forward
# --------------------------------------------------------------------------------------------

CASES = [(8, 8, [20, 20]),  # 16 image tokens (padded to 32), captions padded to 32
         (6, 10, [40, 33]),  # 15 image tokens, captions 40 / 33 -> 64
         (10, 6, [5]),  # batch 1
         (4, 4, [32, 1, 17])]  # 4 image tokens; a caption that needs no padding


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("h,w,lengths", CASES)
def test_the_wrapper_is_the_stock_forward_bit_for_bit(dtype, h, w, lengths):
    """Samples of one padded caption length in one call of the wrapper (rounding 1), each
    equal bit for bit to diffusers' forward of the list: fp32 (the three roundings are one),
    bf16 and fp16 (rounding 1 is diffusers' RMSNorm + complex64 rotation order)."""
    stock = _stock(dtype)
    ours = ZImageCacheInputTransformer(copy.deepcopy(stock), rounding=Z_IMAGE.rounding).eval()
    x, caps, t = _samples(h, w, lengths, dtype)
    s = max(padded(n) for n in lengths)
    if any(padded(n) != s for n in lengths):
        pytest.fail("a case must hold one padded caption length")
    with torch.no_grad():
        want = stock(x, t, caps, return_dict=False)[0]
        ehs = torch.zeros(len(lengths), s, 16, dtype=dtype)
        mask = torch.zeros(len(lengths), s, dtype=torch.bool)
        for i, c in enumerate(caps):
            ehs[i, :len(c)], mask[i, :len(c)] = c, True
        caches = caches_for_sizes([(1, h // 2, w // 2)], s, axes=AXES, theta=THETA)
        out = ours(_patchify(x), ehs, mask, t, caches.img, caches.txt)
    got = _unpatchify(out, x[0].shape)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype == dtype
        assert torch.equal(a, b), float((a.float() - b.float()).abs().max())


def test_rounding_0_is_not_diffusers_order_in_bf16():
    """The bit-exactness above is the rounding mode's doing: rounding 0 (one rounding at the
    end) differs from diffusers' bf16 forward."""
    stock = _stock(torch.bfloat16)
    ours = ZImageCacheInputTransformer(copy.deepcopy(stock), rounding=0).eval()
    x, caps, t = _samples(8, 8, [20, 20], torch.bfloat16)
    with torch.no_grad():
        want = stock(x, t, caps, return_dict=False)[0]
        caches = caches_for_sizes([(1, 4, 4)], 32, axes=AXES, theta=THETA)
        ehs = torch.zeros(2, 32, 16, dtype=torch.bfloat16)
        ehs[:, :20] = torch.stack(caps)
        mask = torch.arange(32)[None].expand(2, -1) < 20
        out = ours(_patchify(x), ehs, mask, t, caches.img, caches.txt)
    assert not all(torch.equal(a, b) for a, b in zip(_unpatchify(out, x[0].shape), want))


# --------------------------------------------------------------------------------------------
# The export, through ONNX Runtime and the drop-in
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    pytest.importorskip("onnxruntime", reason="requires onnxruntime")
    from qkrope.export.onnx_export import export_transformer

    root = tmp_path_factory.mktemp("z-image")
    folder = BUILDER.saved(root)
    path = root / "z-image.onnx"
    # traced: batch 2, 16 image tokens (padded to 32 in the graph), 32 caption tokens
    export_transformer(path, folder, dtype="fp32", progress=False, img_shapes=[(1, 4, 4)],
                       txt_len=32, batch=2)
    return path


def test_the_graph_has_one_fused_node_per_attention_and_no_double(exported):
    import onnx

    model = onnx.load(str(exported))
    nodes = [n for n in model.graph.node if n.op_type == "QKNormRoPE"]
    cfg = Z_IMAGE_CONFIG
    assert len(nodes) == 2 * cfg["n_refiner_layers"] + cfg["n_layers"]
    assert all(next(a.i for a in n.attribute if a.name == "rounding") == Z_IMAGE.rounding
               for n in nodes)
    assert not any(v.type.tensor_type.elem_type == onnx.TensorProto.DOUBLE
                   for v in list(model.graph.input) + list(model.graph.output))


@pytest.mark.parametrize("h,w,lengths", [(8, 8, [20, 5]), (6, 10, [40, 40, 3]),
                                         (12, 4, [70]), (16, 16, [1, 64, 65, 100])])
def test_the_drop_in_runs_untraced_shapes_within_the_bound(exported, h, w, lengths):
    """ONNX Runtime through the drop-in at other image sizes (with and without image padding),
    batch sizes and caption lengths, several caption lengths per call (one graph call per
    padded length), against the stock forward of the same list."""
    from qkrope.runtime import load_transformer

    stock = _stock()
    dropin = load_transformer(exported)
    assert isinstance(dropin, ZImageTransformer)
    x, caps, t = _samples(h, w, lengths, torch.float32, seed=1)
    with torch.no_grad():
        want = stock(x, t, caps, return_dict=False)[0]
    got = dropin(x, t, caps, return_dict=False)[0]
    for a, b in zip(got, want):
        assert a.shape == b.shape
        bound = Z_IMAGE_PARITY * float(b.abs().max())
        assert float((a - b).abs().max()) <= bound


def test_caches_for_an_export_are_the_pipelines(exported):
    """caches_for(model, txt_ids=..., img_ids=...): the scheme and axes from the sidecar."""
    from qkrope.runtime import caches_for

    from qkrope.families.z_image.dropin import sample_ids

    txt, img = sample_ids([(1, 4, 6)], 32)
    got = caches_for(exported, txt_ids=txt, img_ids=img)
    want = caches_for_sizes([(1, 4, 6)], 32, axes=AXES, theta=THETA)
    assert torch.equal(got.img, want.img) and torch.equal(got.txt, want.txt)
    with pytest.raises(InputError, match="txt_ids, img_ids"):
        caches_for(exported, [(1, 4, 6)], 32)


def test_drop_in_forms(exported):
    """return_dict, a stacked latent tensor and a scalar timestep, and LoRA scale 1."""
    from qkrope.runtime import load_transformer

    dropin = load_transformer(exported)
    x, caps, t = _samples(8, 8, [20, 5], torch.float32)
    base = dropin(x, t, caps, return_dict=False)[0]
    assert dropin(x, t, caps).sample[0].shape == base[0].shape
    again = dropin(torch.stack(x), t, caps, return_dict=False,
                   joint_attention_kwargs={"scale": 1.0})[0]
    assert all(torch.equal(a, b) for a, b in zip(again, base))
    one = dropin(x, torch.tensor(0.5), caps, return_dict=False)[0]
    two = dropin(x, torch.tensor([0.5, 0.5]), caps, return_dict=False)[0]
    assert all(torch.equal(a, b) for a, b in zip(one, two))


@pytest.mark.parametrize("bad,match", [
    (dict(controlnet_block_samples={0: torch.zeros(1)}), "ControlNet"),
    (dict(siglip_feats=[[None]]), "Omni"),
    (dict(image_noise_mask=[[1]]), "Omni"),
    (dict(x=[[torch.zeros(16, 1, 8, 8)], [torch.zeros(16, 1, 8, 8)]]), "nested list"),
    (dict(patch_size=4), "patch size"),
    (dict(joint_attention_kwargs={"scale": 0.5}), "LoRA scale"),
    (dict(cap_feats=[torch.zeros(3, 16)]), "one caption per latent"),
    (dict(cap_feats=[torch.zeros(300, 16)] * 2), "RoPE tables"),
    (dict(x=[torch.zeros(16, 1, 7, 8)] * 2), "multiples of 2"),
    (dict(t=torch.zeros(3)), "timesteps"),
    (dict(x=None), "needs x"),
])
def test_refusals(exported, bad, match):
    from qkrope.runtime import load_transformer

    dropin = load_transformer(exported)
    x, caps, t = _samples(8, 8, [20, 5], torch.float32)
    kw = {**dict(x=x, t=t, cap_feats=caps, return_dict=False), **bad}
    with pytest.raises(InputError, match=match) as e:
        dropin(**kw)
    assert "\n" not in str(e.value)


def test_an_omni_model_is_refused_before_export(tmp_path):
    import json

    from qkrope.families.z_image.export import check_config

    (tmp_path / "config.json").write_text(json.dumps({"_class_name": Z_IMAGE.class_name,
                                                      "siglip_feat_dim": 32}))
    with pytest.raises(InputError, match="Omni") as e:
        check_config(str(tmp_path), None, torch.float32)
    assert "\n" not in str(e.value)


# --------------------------------------------------------------------------------------------
# The pipelines
# --------------------------------------------------------------------------------------------

def _vae():
    from qkrope.families.z_image.tiny import vae

    return vae()  # diffusers' Z-Image pipeline-test VAE: one home, the family's tiny recipe


def _embeds(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, 16, generator=g) for n in lengths]


def latent_bound(reference: torch.Tensor, cfg_scale: float) -> float:
    """As FLUX's pipelines (tests/test_flux_pipeline.py): each call within Z_IMAGE_PARITY x
    its magnitude; a flow-matching Euler step adds (sigma_next - sigma) x prediction with the
    sigmas travelling at most 1 in total; CFG (pos + s (pos - neg)) amplifies a prediction's
    error by at most 1 + 2 s; the predictions are of the latents' magnitude."""
    return float(Z_IMAGE_PARITY * (1 + 2 * max(cfg_scale, 1.0)) * reference.abs().max())


@pytest.mark.parametrize("kind", ["text", "img2img", "inpaint"])
def test_the_pipelines_run_on_the_export(exported, kind):
    """ZImagePipeline / ZImageImg2ImgPipeline / ZImageInpaintPipeline with true CFG (a negative
    prompt of another padded length: two graph calls per step), 2 images per prompt, at a size
    other than the traced one, on the stock transformer and on the export (`pipe.transformer =
    load_transformer(...)`, the user's one line): the latents agree within the bound."""
    from PIL import Image

    from qkrope.runtime import load_transformer

    cls = {"text": diffusers.ZImagePipeline, "img2img": diffusers.ZImageImg2ImgPipeline,
           "inpaint": diffusers.ZImageInpaintPipeline}[kind]
    pipes = [cls(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=_vae(),
                 text_encoder=None, tokenizer=None, transformer=_stock()) for _ in range(2)]
    pipes[1].transformer = load_transformer(exported)
    kw = dict(prompt_embeds=_embeds([40], 1), negative_prompt_embeds=_embeds([7], 2),
              guidance_scale=3.0, num_inference_steps=2, height=48, width=32,
              num_images_per_prompt=2, output_type="latent")
    if kind != "text":
        pixels = np.random.default_rng(0).random((48, 32, 3)) * 255
        kw.update(image=Image.fromarray(pixels.astype(np.uint8)), strength=0.9)
    if kind == "inpaint":
        mask = np.zeros((48, 32), np.uint8)
        mask[8:40, 8:24] = 255
        kw.update(mask_image=Image.fromarray(mask))
    want, got = (p(**kw, generator=torch.Generator().manual_seed(0)).images for p in pipes)
    assert got.shape == want.shape and got.shape[0] == 2
    assert float((got - want).abs().max()) <= latent_bound(want, 3.0)
