"""PRX (PRXTransformer2DModel, qkrope/families/prx): its cache-input wrapper bit for bit
diffusers' forward (fp32, bf16, fp16) and the node bit for bit the model's own norm + RoPE in
the record's rounding; the export at untraced shapes in ONNX Runtime within the FLUX tests'
derived per-call bound; the drop-in in PRXPipeline at an untraced size with classifier-free
guidance (latents within tiny_pipeline.latent_bound); the refusals. The tiny transformer is the
family's tiny recipe (1 block, 2 heads x 16, RoPE axes (8, 8), 2 x 2 patches)."""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")

import torch  # noqa: E402

from qkrope import contract, families  # noqa: E402
from qkrope.errors import InputError  # noqa: E402
from qkrope.runtime.latents import pack_patches  # noqa: E402

PRX = families.by_name("prx")
TINY = families.hooks(PRX, "tiny")
#: the per-call bound of an export in fp32 (tests/_flux_models.py: its derivation)
PARITY = 5e-4


def _inputs(model, batch=2, h=10, w=6, txt=7, seed=3):
    """A 4-D latent of an untraced size, text with a padded last item, per-item timesteps."""
    g = torch.Generator().manual_seed(seed)
    dtype = model.dtype
    mask = torch.ones(batch, txt, dtype=torch.bool)
    mask[-1, txt // 2:] = False
    return dict(hidden_states=torch.randn(batch, 4, h, w, generator=g).to(dtype),
                timestep=torch.rand(batch, generator=g),
                encoder_hidden_states=torch.randn(batch, txt, 16, generator=g).to(dtype),
                attention_mask=mask)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
def test_wrapper_is_bit_exact_with_diffusers(dtype):
    from qkrope.families.prx import export

    model = TINY.build_transformer(PRX, 0).to(dtype)
    kw = _inputs(model)
    with torch.no_grad():
        want = model(**kw, return_dict=False)[0]
    wrapper = export.PRXCacheInputTransformer(copy.deepcopy(model), PRX, PRX.rounding)
    h, w = (int(v) // 2 for v in kw["hidden_states"].shape[2:])
    cache = export.sample_cache(PRX, (h, w), export.rope_setting(model)[0], 10000)
    with torch.no_grad():
        got = wrapper(pack_patches(kw["hidden_states"], (2, 2))[0], kw["encoder_hidden_states"],
                      kw["attention_mask"].long(), kw["timestep"], cache)
    assert torch.equal(got, pack_patches(want, (2, 2))[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_the_node_is_the_models_norm_and_rope_in_its_rounding(dtype):
    """diffusers' norm_q then apply_rope with the model's own tables: bit for bit the node in
    the record's rounding (each step) and in no other mode."""
    from diffusers.models.transformers.transformer_prx import apply_rope, get_image_ids

    from qkrope.export.ops import qk_norm_rope
    from qkrope.families.prx import export

    model = TINY.build_transformer(PRX, 0).to(dtype)
    norm = model.blocks[0].attention.norm_q
    h, w = 5, 7
    tables = model.pe_embedder(get_image_ids(1, 2 * h, 2 * w, 2, "cpu"))
    cache = export.sample_cache(PRX, (h, w), (8, 8), 10000)
    q = (torch.randn(1, 2, h * w, 16, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    with torch.no_grad():
        want = apply_rope(norm(q), tables)
        exact = {mode for mode in contract.ROUNDING_MODES if torch.equal(
            qk_norm_rope(q.transpose(1, 2), q.transpose(1, 2), norm.weight, norm.weight, cache,
                         eps=norm.eps, rounding=mode)[0].transpose(1, 2), want)}
    assert exact == {PRX.rounding}


def test_a_resolution_embedding_is_refused_in_one_line():
    from qkrope.families.prx import export

    model = TINY.build_transformer(PRX, 0, resolution_embeds=True)
    with pytest.raises(InputError, match="resolution_embeds") as e:
        export.check_supported(model)
    assert "\n" not in str(e.value)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from qkrope.export.api import export_transformer

    root = tmp_path_factory.mktemp("prx")
    TINY.build_transformer(PRX, 0).save_pretrained(str(root / "diffusers"))
    export_transformer(root / "diffusers", root / "prx.onnx", dtype="fp32", progress=False)
    return root / "prx.onnx"


@pytest.mark.slow  # the module's export (~20 s on 2 cores)
def test_onnxruntime_at_untraced_shapes(exported):
    import onnx

    from qkrope.runtime import load_transformer

    nodes = sum(n.op_type == "QKNormRoPE" for n in onnx.load(str(exported)).graph.node)
    assert nodes == 1  # one per block
    model = TINY.build_transformer(PRX, 0)
    dropin = load_transformer(exported)
    for size in ((14, 18, 9), (6, 20, 3)):
        kw = _inputs(model, h=size[0], w=size[1], txt=size[2], seed=11)
        with torch.no_grad():
            want = model(**kw, return_dict=False)[0]
        got = dropin(**kw, return_dict=False)[0]
        err, scale = float((got - want).abs().max()), float(want.abs().max())
        assert got.shape == want.shape and 0 < err <= PARITY * scale, (size, err, scale)


@pytest.mark.slow  # the module's export, and two pipeline runs
def test_pipeline_on_the_dropin(exported):
    """PRXPipeline at 40 x 24 (untraced, no resolution binning), CFG 3, 2 steps, on prompt
    embeddings with padded masks (its prompt path needs ftfy): the drop-in's latents within the
    derived bound of the stock model's."""
    from qkrope.apps import tiny_pipeline as tp
    from qkrope.runtime import load_transformer

    pipe = TINY.build_pipeline(PRX, 0)
    g = torch.Generator().manual_seed(5)
    embeds = [torch.randn(1, 6, 16, generator=g) for _ in range(2)]
    masks = [torch.tensor([[True] * k + [False] * (6 - k)]) for k in (4, 2)]
    call = dict(prompt_embeds=embeds[0], negative_prompt_embeds=embeds[1],
                prompt_attention_mask=masks[0], negative_prompt_attention_mask=masks[1],
                height=40, width=24, num_inference_steps=2, guidance_scale=3.0,
                use_resolution_binning=False, output_type="latent")
    want = pipe(generator=torch.Generator().manual_seed(0), **call).images
    pipe.transformer = load_transformer(exported)
    got = pipe(generator=torch.Generator().manual_seed(0), **call).images
    assert got.shape == want.shape
    diff = float((got - want).abs().max())
    assert 0 < diff <= tp.latent_bound(want, 3.0, parity=PARITY), diff


REFUSED = [(dict(attention_kwargs={"scale": 0.5}), "attention_kwargs"),
           (dict(attention_mask=torch.ones(2, 3, dtype=torch.bool)), "attention_mask"),
           (dict(hidden_states=torch.zeros(2, 4, 5, 6)), "patch")]


@pytest.mark.slow  # the module's export
@pytest.mark.parametrize("extra, match", REFUSED, ids=[m for _, m in REFUSED])
def test_refusals(exported, extra, match):
    from qkrope.runtime import load_transformer

    dropin = load_transformer(exported)
    kw = dict(_inputs(TINY.build_transformer(PRX, 0)), **extra)
    with pytest.raises(InputError, match=match) as e:
        dropin(**kw)
    assert "\n" not in str(e.value)
