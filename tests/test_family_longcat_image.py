"""LongCat-Image (diffusers' LongCatImageTransformer2DModel) on the shared dual-stream helper: the
record against the model, the cache-input wrapper bit-exact with diffusers' forward in fp32
and bf16, ONNX Runtime at untraced shapes within the FLUX tests' derived per-call bound
(_flux_models.FLUX_TRANSFORMER_PARITY of max|output|), the drop-in in LongCatImagePipeline at an
untraced size (latents within tiny_pipeline.latent_bound of the same call on the stock model),
and its refusals. The tiny transformer is the family's tiny recipe (FLUX.1's diffusers test
sizes: 1 + 1 blocks, 2 heads x 16, RoPE axes (4, 4, 8); 64 input channels, the pipeline's
16 latent channels packed 2 x 2)."""

from __future__ import annotations

import pytest

pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")
pytest.importorskip("onnxruntime", reason="requires onnxruntime")

import torch  # noqa: E402

import _flux_models as fm  # noqa: E402
from _families import BUILDERS  # noqa: E402
from qkrope import families  # noqa: E402
from qkrope.errors import InputError  # noqa: E402
from qkrope.families.longcat_image import DUAL_STREAM, LONGCAT_IMAGE  # noqa: E402

BUILDER = BUILDERS["longcat-image"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("longcat-image")


@pytest.fixture(scope="module")
def model():
    return BUILDER.build(0).eval()


def test_the_record_is_diffusers_longcat_image(model):
    assert families.family_of(dict(model.config, _class_name=type(model).__name__)) \
        is LONGCAT_IMAGE
    assert model.pos_embed.theta == LONGCAT_IMAGE.theta
    names = {n for n, _ in model.named_children()}
    assert set(LONGCAT_IMAGE.fp8_excluded) <= names
    assert {b.attr for b in LONGCAT_IMAGE.block_lists} <= names


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
def test_wrapper_is_bit_exact_with_diffusers(dtype):
    """Two batch items, an untraced 3 x 5 image and 7 text tokens: the wrapper (the fused op's
    eager maths in the record's rounding) equals diffusers' forward bit for bit
    (:func:`_flux_models.clone_bit_exact`)."""
    fm.clone_bit_exact(BUILDER, LONGCAT_IMAGE, DUAL_STREAM, dtype)


def test_onnxruntime_at_untraced_shapes(root, model):
    onnx = fm.clone_exported(BUILDER, root)
    kw = fm.clone_inputs(DUAL_STREAM, model.config, [(1, 5, 3)], 9, 3, seed=11)
    err, scale = fm.clone_ort_error(LONGCAT_IMAGE, model, onnx, kw)
    assert 0 < err <= fm.FLUX_TRANSFORMER_PARITY * scale, (err, scale)


def _pipe(transformer):
    import diffusers

    from qkrope.families.longcat_image import tiny

    tok, encoder = tiny.text_encoder(0)
    return diffusers.LongCatImagePipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=tiny.vae(),
        text_encoder=encoder, tokenizer=tok, text_processor=None, transformer=transformer)


def test_pipeline_on_the_dropin(root, model):
    """LongCatImagePipeline at 40 x 24 (untraced), CFG with its renorm, 2 steps, from a
    prompt (the tiny text encoder; no prompt rewrite): the drop-in's latents within the derived
    bound of the stock model's. (Its prompt_embeds path needs a prompt that check_inputs
    refuses beside them, in diffusers 0.42.1.)"""
    from qkrope.apps import tiny_pipeline as tp
    from qkrope.runtime import load_transformer

    call = dict(prompt="a cat", height=40, width=24,
                num_inference_steps=2, guidance_scale=3.0, enable_prompt_rewrite=False,
                output_type="latent")
    want = _pipe(model)(generator=torch.Generator().manual_seed(0), **call).images
    dropin = load_transformer(fm.clone_exported(BUILDER, root))
    got = _pipe(dropin)(generator=torch.Generator().manual_seed(0), **call).images
    assert got.shape == want.shape
    diff = float((got - want).abs().max())
    assert 0 < diff <= tp.latent_bound(want, 3.0, parity=fm.FLUX_TRANSFORMER_PARITY), diff


def test_refusals_and_guidance_ignored(root):
    """guidance (which LongCatImagePipeline passes and diffusers' model ignores) changes
    nothing; another family's arguments and pooled projections are one line each."""
    from qkrope.runtime import load_transformer

    dropin = load_transformer(fm.clone_exported(BUILDER, root))
    kw = fm.clone_inputs(DUAL_STREAM, dropin.config, [(1, 2, 2)], 3, 1)
    plain = dropin(**kw, return_dict=False)[0]
    assert torch.equal(dropin(**kw, guidance=torch.full((1,), 4.5), return_dict=False)[0],
                       plain)
    with pytest.raises(InputError, match="joint_attention_kwargs") as exc:
        dropin(**kw, joint_attention_kwargs={"scale": 0.5})
    assert "\n" not in str(exc.value)
