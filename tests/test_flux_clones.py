"""The dual-stream clones on the shared helper (export/dual_stream.py, runtime/dual_stream.py),
one test per check, parametrised over the clones: LongCat-Image, Ovis-Image, Bria 3.2. For each:
the record against the model, the cache-input wrapper bit-exact with diffusers' forward in fp32
(and the node bit-exact with the model's own norm + RoPE in fp16 / bf16), ONNX Runtime at
untraced shapes within the FLUX tests' derived per-call bound
(_flux_models.FLUX_TRANSFORMER_PARITY of max|output|), the drop-in in the clone's pipeline at an
untraced size with its classifier-free guidance (latents within tiny_pipeline.latent_bound of
the same call on the stock model), and its refusals. The tiny transformers are the families'
tiny recipes (FLUX.1's diffusers test sizes: 1 + 1 blocks, 2 heads x 16, RoPE axes (4, 4, 8))."""

from __future__ import annotations

import importlib

import pytest

pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")
pytest.importorskip("onnxruntime", reason="requires onnxruntime")
pytest.importorskip("transformers", reason="LongCat-Image's pipeline test builds its encoder")

import torch  # noqa: E402

import _flux_models as fm  # noqa: E402
from _families import BUILDERS  # noqa: E402
from qkrope import families  # noqa: E402
from qkrope.errors import InputError  # noqa: E402

CLONES = ("longcat-image", "ovis-image", "bria")


def _family(name):
    """(builder, record, DualStream, tiny hook module) of a clone."""
    record = families.by_name(name)
    package = importlib.import_module(f"qkrope.families.{record.package}")
    return BUILDERS[name], record, package.DUAL_STREAM, families.hooks(record, "tiny")


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("flux-clones")


@pytest.mark.parametrize("name", CLONES)
def test_the_record_is_the_model(name):
    builder, record, _, _ = _family(name)
    model = builder.build(0)
    assert families.family_of(dict(model.config, _class_name=type(model).__name__)) is record
    assert model.pos_embed.theta == record.rope_theta(model.config)
    names = {n for n, _ in model.named_children()}
    assert set(record.fp8_excluded) <= names
    assert {b.attr for b in record.block_lists} <= names


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("name", CLONES)
def test_wrapper_is_bit_exact_with_diffusers(name, dtype):
    builder, record, spec, _ = _family(name)
    fm.clone_bit_exact(builder, record, spec, dtype)


@pytest.mark.parametrize("name", CLONES)
def test_onnxruntime_at_untraced_shapes(root, name):
    builder, record, spec, _ = _family(name)
    model = builder.build(0).eval()
    kw = fm.clone_inputs(spec, model.config, [(1, 5, 3)], 9, 3, seed=11)
    err, scale = fm.clone_ort_error(record, model, fm.clone_exported(builder, root), kw)
    assert 0 < err <= fm.FLUX_TRANSFORMER_PARITY * scale, (err, scale)


def _pipeline(name, transformer):
    """The clone's pipeline on ``transformer`` and the call's text arguments: prompt embeddings
    where the pipeline takes them alone; LongCat-Image's prompt_embeds path also needs the
    prompt that its check_inputs refuses beside them (diffusers 0.42.1), so it runs its tiny
    text encoder on a prompt, without the prompt rewrite."""
    import diffusers

    _, _, _, tiny = _family(name)
    common = dict(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), transformer=transformer)
    if name == "longcat-image":
        tok, encoder = tiny.text_encoder(0)
        return (diffusers.LongCatImagePipeline(vae=tiny.vae(), text_encoder=encoder, tokenizer=tok,
                                               text_processor=None, **common),
                dict(prompt="a cat", enable_prompt_rewrite=False))
    from qkrope.apps.tiny_parts import one_level_vae

    cls = {"ovis-image": diffusers.OvisImagePipeline, "bria": diffusers.BriaPipeline}[name]
    g = torch.Generator().manual_seed(5)
    width = transformer.config["joint_attention_dim"]
    embeds = [torch.randn(1, 6, width, generator=g) for _ in range(2)]
    return (cls(vae=one_level_vae("the test"), text_encoder=None, tokenizer=None, **common),
            dict(prompt_embeds=embeds[0], negative_prompt=None, negative_prompt_embeds=embeds[1]))


@pytest.mark.parametrize("name", CLONES)
def test_pipeline_on_the_dropin(root, name):
    """The clone's pipeline at 40 x 24 (untraced), CFG 3, 2 steps: the drop-in's latents within
    the derived bound of the stock model's."""
    from qkrope.apps import tiny_pipeline as tp
    from qkrope.runtime import load_transformer

    builder, _, _, _ = _family(name)
    call = dict(height=40, width=24, num_inference_steps=2, guidance_scale=3.0,
                output_type="latent")
    stock, text = _pipeline(name, builder.build(0).eval())
    want = stock(generator=torch.Generator().manual_seed(0), **text, **call).images
    dropin, text = _pipeline(name, load_transformer(fm.clone_exported(builder, root)))
    got = dropin(generator=torch.Generator().manual_seed(0), **text, **call).images
    assert got.shape == want.shape
    diff = float((got - want).abs().max())
    assert 0 < diff <= tp.latent_bound(want, 3.0, parity=fm.FLUX_TRANSFORMER_PARITY), diff


REFUSED = [
    ("longcat-image", dict(joint_attention_kwargs={"scale": 0.5}), "joint_attention_kwargs"),
    ("ovis-image", dict(joint_attention_kwargs={"scale": 0.5}), "LoRA scale"),
    ("ovis-image", dict(pooled_projections=torch.zeros(1, 32)), "pooled_projections"),
    ("bria", dict(attention_kwargs={"scale": 0.5}), "LoRA scale"),
    ("bria", dict(guidance=torch.full((1,), 3.5)), "guidance was given"),
    ("bria", dict(controlnet_block_samples=[torch.zeros(1)]), "ControlNet"),
]


@pytest.mark.parametrize("name, extra, match", REFUSED, ids=[f"{n}-{next(iter(e))}"
                                                             for n, e, _ in REFUSED])
def test_refusals(root, name, extra, match):
    from qkrope.runtime import load_transformer

    builder, _, spec, _ = _family(name)
    dropin = load_transformer(fm.clone_exported(builder, root))
    kw = fm.clone_inputs(spec, dropin.config, [(1, 2, 2)], 3, 1)
    with pytest.raises(InputError, match=match) as exc:
        dropin(**kw, **extra)
    assert "\n" not in str(exc.value)


def test_longcat_ignores_guidance_as_diffusers_does(root):
    """LongCatImagePipeline passes guidance, which diffusers' model ignores: so does the
    drop-in (the same output bits)."""
    from qkrope.runtime import load_transformer

    builder, _, spec, _ = _family("longcat-image")
    dropin = load_transformer(fm.clone_exported(builder, root))
    kw = fm.clone_inputs(spec, dropin.config, [(1, 2, 2)], 3, 1)
    plain = dropin(**kw, return_dict=False)[0]
    assert torch.equal(dropin(**kw, guidance=torch.full((1,), 4.5), return_dict=False)[0], plain)


# --------------------------------------------------------------------------------------------
# A zero-width RoPE axis: the released Bria 3.2 config has axes_dims_rope [0, 48, 48] (heads of
# 96); diffusers' position embedder gives the 0-wide axis no columns. The same at tiny size.
# --------------------------------------------------------------------------------------------

ZERO_AXIS = [0, 8, 8]  # attention_head_dim 16 (TINY_CONFIG's)


def _zero_axis_builder():
    """The tiny Bria with ``axes_dims_rope`` [0, 8, 8]."""
    from _families import TinyBuilder

    _, _, _, tiny = _family("bria")
    return TinyBuilder("bria", "bria-zero-axis",
                       lambda seed: tiny.bria_transformer(seed, axes_dims_rope=ZERO_AXIS))


def test_ids_caches_of_a_zero_width_axis_are_diffusers_bria_rope():
    """The "ids" caches (the shared builder, through checked_setting) of axes [0, 8, 8] equal
    diffusers' Bria position embedder bit for bit: every integer position 0..4096 on each axis
    and a pipeline's ids; the 0-wide axis contributes no columns."""
    from diffusers.models.transformers.transformer_bria import BriaEmbedND

    from qkrope.runtime.dual_stream import caches_from_ids, sample_ids

    _, _, spec, _ = _family("bria")
    txt, img = sample_ids(spec.ids, [(1, 5, 3)], 7)
    span = torch.arange(4097, dtype=torch.float32)[:, None].expand(4097, 3).contiguous()
    for txt_ids, img_ids in ((torch.from_numpy(txt), torch.from_numpy(img)), (span[:9], span)):
        caches = caches_from_ids("Bria", txt_ids, img_ids, axes_dims=ZERO_AXIS, theta=10000,
                                 head_dim=16)
        for ids, got in ((img_ids, caches.img), (txt_ids, caches.txt)):
            cos, sin = BriaEmbedND(theta=10000, axes_dim=ZERO_AXIS)(ids)
            assert cos.shape == (ids.shape[0], 16) and got.shape == (ids.shape[0], 16)
            # diffusers' tables repeat each pair's value twice; the cache holds cos half, sin half
            assert torch.equal(got[:, :8], cos[:, 0::2]) and torch.equal(got[:, 8:], sin[:, 0::2])


def test_a_zero_width_axis_exports_and_the_dropin_matches_diffusers(root):
    """A tiny Bria with axes [0, 8, 8] exports (export_transformer), and the drop-in
    (load_transformer, caches from the ids) matches diffusers' forward on ONNX Runtime within
    the clones' bound, at an untraced shape."""
    from qkrope.runtime import load_transformer

    builder = _zero_axis_builder()
    _, _, spec, _ = _family("bria")
    model = builder.build(0).eval()
    kw = fm.clone_inputs(spec, model.config, [(1, 5, 3)], 9, 2, seed=11)
    with torch.no_grad():
        want = model(**kw, return_dict=False)[0]
    got = load_transformer(builder.exported(root))(**kw, return_dict=False)[0]
    assert got.shape == want.shape
    err, scale = float((got - want).abs().max()), float(want.abs().max())
    assert 0 < err <= fm.FLUX_TRANSFORMER_PARITY * scale, (err, scale)


@pytest.mark.parametrize("axes, match", [
    ([0, 0, 0], r"or 0 \(an axis not rotated\).*at least one positive"),
    ([0, -2, 18], r"positive even widths or 0"),
    ([0, 7, 9], r"positive even widths or 0"),
])
def test_zero_negative_or_odd_axes_are_one_line(axes, match):
    from qkrope.runtime.dual_stream import caches_from_ids, sample_ids

    _, _, spec, _ = _family("bria")
    txt, img = sample_ids(spec.ids, [(1, 2, 2)], 3)
    with pytest.raises(InputError, match=match) as exc:
        caches_from_ids("Bria", txt, img, axes_dims=axes, theta=10000, head_dim=16)
    assert "\n" not in str(exc.value) and str(axes) in str(exc.value)
