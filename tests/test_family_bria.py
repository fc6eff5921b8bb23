"""Bria 3.2 (diffusers' BriaTransformer2DModel) on the shared dual-stream helper: the
record against the model, the cache-input wrapper bit-exact with diffusers' forward in fp32
and bf16, ONNX Runtime at untraced shapes within the FLUX tests' derived per-call bound
(_flux_models.FLUX_TRANSFORMER_PARITY of max|output|), the drop-in in BriaPipeline at an
untraced size (latents within tiny_pipeline.latent_bound of the same call on the stock model),
and its refusals. The tiny transformer is the family's tiny recipe (FLUX.1's diffusers test
sizes: 1 + 1 blocks, 2 heads x 16, RoPE axes (4, 4, 8))."""

from __future__ import annotations

import pytest

pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")
pytest.importorskip("onnxruntime", reason="requires onnxruntime")

import torch  # noqa: E402

import _flux_models as fm  # noqa: E402
from _families import BUILDERS  # noqa: E402
from qkrope import families  # noqa: E402
from qkrope.errors import InputError  # noqa: E402
from qkrope.families.bria import DUAL_STREAM, BRIA  # noqa: E402

BUILDER = BUILDERS["bria"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("bria")


@pytest.fixture(scope="module")
def model():
    return BUILDER.build(0).eval()


def test_the_record_is_diffusers_bria(model):
    assert families.family_of(dict(model.config, _class_name=type(model).__name__)) \
        is BRIA
    assert model.pos_embed.theta == BRIA.theta
    names = {n for n, _ in model.named_children()}
    assert set(BRIA.fp8_excluded) <= names
    assert {b.attr for b in BRIA.block_lists} <= names


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
def test_wrapper_is_bit_exact_with_diffusers(dtype):
    """Two batch items, an untraced 3 x 5 image and 7 text tokens: the wrapper (the fused op's
    eager maths in the record's rounding) equals diffusers' forward bit for bit
    (:func:`_flux_models.clone_bit_exact`)."""
    fm.clone_bit_exact(BUILDER, BRIA, DUAL_STREAM, dtype)


def test_onnxruntime_at_untraced_shapes(root, model):
    onnx = fm.clone_exported(BUILDER, root)
    kw = fm.clone_inputs(DUAL_STREAM, model.config, [(1, 5, 3)], 9, 3, seed=11)
    err, scale = fm.clone_ort_error(BRIA, model, onnx, kw)
    assert 0 < err <= fm.FLUX_TRANSFORMER_PARITY * scale, (err, scale)


def _pipe(transformer):
    import diffusers

    from qkrope.families.bria import tiny

    return diffusers.BriaPipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=tiny.vae(),
        text_encoder=None, tokenizer=None, transformer=transformer)


def test_pipeline_on_the_dropin(root, model):
    """BriaPipeline at 40 x 24 (untraced), true CFG, 2 steps, from prompt embeddings:
    the drop-in's latents within the derived bound of the stock model's."""
    from qkrope.apps import tiny_pipeline as tp
    from qkrope.runtime import load_transformer

    g = torch.Generator().manual_seed(5)
    embeds = torch.randn(1, 6, model.config["joint_attention_dim"], generator=g)
    negative = torch.randn(1, 6, model.config["joint_attention_dim"], generator=g)
    call = dict(prompt_embeds=embeds, negative_prompt=None, negative_prompt_embeds=negative,
                height=40, width=24,
                num_inference_steps=2, guidance_scale=3.0, output_type="latent")
    want = _pipe(model)(generator=torch.Generator().manual_seed(0), **call).images
    dropin = load_transformer(fm.clone_exported(BUILDER, root))
    got = _pipe(dropin)(generator=torch.Generator().manual_seed(0), **call).images
    assert got.shape == want.shape
    diff = float((got - want).abs().max())
    assert 0 < diff <= tp.latent_bound(want, 3.0, parity=fm.FLUX_TRANSFORMER_PARITY), diff


def test_refusals(root):
    from qkrope.runtime import load_transformer

    dropin = load_transformer(fm.clone_exported(BUILDER, root))
    kw = fm.clone_inputs(DUAL_STREAM, dropin.config, [(1, 2, 2)], 3, 1)
    with pytest.raises(InputError, match="LoRA scale") as exc:
        dropin(**kw, attention_kwargs={"scale": 0.5})
    assert "\n" not in str(exc.value)
    with pytest.raises(InputError, match="guidance was given"):
        dropin(**kw, guidance=torch.full((1,), 3.5))
    with pytest.raises(InputError, match="pooled_projections"):
        dropin(**kw, pooled_projections=torch.zeros(1, 32))
