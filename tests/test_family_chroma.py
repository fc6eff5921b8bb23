"""Chroma (diffusers' ChromaTransformer2DModel; the tiny builder of tests/_families.py, diffusers'
pipeline-test sizes): the cache-input wrapper is bit-exact with diffusers' own forward in fp32,
bf16 and fp16 (FLUX's rounding order, contract.ROUNDING_TWO_STEPS, matches: Chroma is FLUX.1's
attention code), the caches are FluxPosEmbed's, the export has one QKNormRoPE node per stream
per attention and the text mask as an input, ONNX Runtime agrees with diffusers at untraced
shapes, the three Chroma pipelines run end to end on the export through the drop-in, and what
the graph cannot take is refused in one line."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

diffusers = pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")
pytest.importorskip("transformers", reason="diffusers' Chroma pipelines import transformers")

from _families import CHROMA_CONFIG, chroma_transformer  # noqa: E402

from qkrope import contract, families  # noqa: E402
from qkrope.errors import InputError  # noqa: E402
from qkrope.families.chroma import CHROMA  # noqa: E402
from qkrope.families.chroma.dropin import (ChromaTransformer, IPAdapterUnsupportedError,  # noqa: E402
                                           caches_from_ids, sample_ids)

#: fp32 ulp at 1, relative to an output's magnitude: the least error bound worth stating
FP32_EPS = 2.0 ** -23


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """``qkrope export --model transformer`` of the tiny model (traced at the default sample:
    one 8 x 8 image, 16 text tokens, batch 2)."""
    from qkrope.cli import main

    root = tmp_path_factory.mktemp("chroma")
    folder = root / "chroma-diffusers"
    chroma_transformer(0).save_pretrained(str(folder))
    out = root / "chroma.onnx"
    assert main(["export", "--model", "transformer", "--diffusers", str(folder), "--out",
                 str(out)]) == 0
    return out


def _call(batch, h, w, txt, seed, dtype=torch.float32, padded=True):
    """diffusers' forward arguments as ChromaPipeline makes them: 2-D ids, the attention mask =
    [text mask (the last item's second half padding); ones for the image] in the model's
    dtype (the prompt mask is the embeddings' dtype, joined with bool ones)."""
    txt_ids, img_ids = (torch.from_numpy(a) for a in sample_ids([(1, h, w)], txt))
    g = torch.Generator().manual_seed(seed)
    text_mask = torch.ones(batch, txt)
    if padded:
        text_mask[-1, txt // 2:] = 0
    return dict(hidden_states=torch.randn(batch, h * w, 4, generator=g).to(dtype),
                encoder_hidden_states=torch.randn(batch, txt, 32, generator=g).to(dtype),
                timestep=torch.rand(batch, generator=g).to(dtype), img_ids=img_ids,
                txt_ids=txt_ids,
                attention_mask=torch.cat([text_mask.to(dtype),
                                          torch.ones(batch, h * w, dtype=torch.bool)], dim=1))


def _wrapped(model, kw):
    """The cache-input wrapper's output for diffusers' arguments ``kw``."""
    from qkrope.export.dual_stream import cache_input
    from qkrope.families.chroma import DUAL_STREAM
    from qkrope.families.chroma.export import ChromaCacheInputTransformer

    cfg = model.config
    caches = caches_from_ids(kw["txt_ids"], kw["img_ids"], axes_dims=cfg["axes_dims_rope"],
                             theta=model.pos_embed.theta, head_dim=cfg["attention_head_dim"])
    s_txt = kw["encoder_hidden_states"].shape[1]
    wrapper = cache_input(ChromaCacheInputTransformer, model, CHROMA, DUAL_STREAM,
                          CHROMA.kept_blocks(cfg, None), rounding=CHROMA.rounding)
    with torch.no_grad():
        return wrapper(kw["hidden_states"], kw["encoder_hidden_states"],
                       kw["attention_mask"][:, :s_txt], kw["timestep"], caches.img, caches.txt)


# --------------------------------------------------------------------------------------------
# The record, the caches, eager parity
# --------------------------------------------------------------------------------------------

def test_the_record_is_diffusers_chroma():
    """Told by config.json's class; the RoPE axes and theta are the ones diffusers builds the
    model with by default (FluxPosEmbed(theta=10000) is fixed in its code)."""
    import inspect

    assert families.family_of({"_class_name": "ChromaTransformer2DModel"}) is CHROMA
    assert families.by_name("chroma") is CHROMA and CHROMA.scheme == "ids"
    default = inspect.signature(diffusers.ChromaTransformer2DModel.__init__).parameters
    assert tuple(default["axes_dims_rope"].default) == CHROMA.axes
    assert chroma_transformer(0).pos_embed.theta == CHROMA.theta
    assert CHROMA.rounding == contract.ROUNDING_TWO_STEPS


def test_caches_are_diffusers_flux_pos_embed():
    """The caches of the pipelines' ids are FluxPosEmbed's (cos, sin) over cat(txt_ids,
    img_ids), bit for bit: cos half = cos[:, 0::2], sin half = sin[:, 0::2]."""
    from diffusers.models.transformers.transformer_flux import FluxPosEmbed

    txt_ids, img_ids = (torch.from_numpy(a) for a in sample_ids([(1, 6, 5)], 11))
    cos, sin = FluxPosEmbed(CHROMA.theta, list(CHROMA.axes))(torch.cat([txt_ids, img_ids]))
    got = caches_from_ids(txt_ids, img_ids, axes_dims=CHROMA.axes, theta=CHROMA.theta,
                          head_dim=128)
    assert got.img.dtype == torch.float32 and got.txt.shape == (11, 128)
    assert torch.equal(torch.cat([got.txt, got.img]), torch.cat([cos[:, 0::2], sin[:, 0::2]],
                                                                dim=-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=["fp32", "bf16", "fp16"])
def test_wrapper_is_bit_exact_with_diffusers(dtype):
    """Every norm + RoPE through the fused op (rounding=2, FLUX's eager order: torch's RMSNorm
    rounds x * inv * w once, diffusers rotates in fp32 and rounds again), the text mask joined
    with ones for the image, the approximator's input built without the batch-size list: bit
    for bit diffusers' forward in every dtype, with a padded prompt in the batch."""
    model = chroma_transformer(0).to(dtype)
    stock = chroma_transformer(0).to(dtype)
    kw = _call(2, 3, 5, 7, seed=3, dtype=dtype)
    with torch.no_grad():
        want = stock(**kw, return_dict=False)[0]
    assert torch.equal(_wrapped(model, kw), want)


def test_the_mask_changes_the_output():
    """The padding is not a no-op (so the bit-exact test above covers the mask): the same call
    without padding gives another output."""
    kw = _call(2, 3, 5, 7, seed=3)
    plain = _call(2, 3, 5, 7, seed=3, padded=False)
    model = chroma_transformer(0)
    assert not torch.equal(_wrapped(model, kw), _wrapped(model, plain))


# --------------------------------------------------------------------------------------------
# The exported graph and ONNX Runtime
# --------------------------------------------------------------------------------------------

def test_graph(exported):
    """Three QKNormRoPE nodes (two in the double-stream block, one in the single-stream one),
    the record's inputs with the text mask in the model's float dtype, no float64."""
    import onnx

    model = onnx.load(str(exported))
    nodes = [n for n in model.graph.node if n.op_type == contract.OP_TYPE]
    assert len(nodes) == 2 * CHROMA_CONFIG["num_layers"] + CHROMA_CONFIG["num_single_layers"]
    assert [i.name for i in model.graph.input] == list(CHROMA.graph.input_names)
    mask = next(i for i in model.graph.input if i.name == "encoder_hidden_states_mask")
    assert mask.type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    double = onnx.TensorProto.DOUBLE
    inferred = onnx.shape_inference.infer_shapes(model).graph
    assert not [v.name for v in list(inferred.value_info) + list(inferred.input)
                + list(inferred.output) if v.type.tensor_type.elem_type == double]
    assert not [t.name for t in inferred.initializer if t.data_type == double]


@pytest.mark.parametrize("batch,h,w,txt", [(1, 3, 5, 9), (3, 4, 4, 5)])
def test_onnxruntime_at_untraced_shapes(exported, batch, h, w, txt):
    """The drop-in over ONNX Runtime vs diffusers at shapes the export never traced. Bound: both
    are fp32 evaluations of one computation in different orders (ONNX Runtime's matmuls,
    attention as MatMul/Softmax/MatMul, the node's function body), so each lies within fp32
    rounding of the float64 forward; the export's distance from it is held to 4 x diffusers'
    own fp32 distance (at least 4 fp32 ulps of max|output|): the same order of rounding error,
    a margin of 4 for the different summation orders (measured on the 2-core EPYC: ratio <= 1.6)."""
    from qkrope.runtime import load_transformer

    kw = _call(batch, h, w, txt, seed=5)
    stock = chroma_transformer(0)
    exact = chroma_transformer(0).double()
    with torch.no_grad():
        want = stock(**kw, return_dict=False)[0]
        truth = exact(**{k: (v.double() if k in ("hidden_states", "encoder_hidden_states",
                                                 "timestep", "attention_mask") else v)
                         for k, v in kw.items()}, return_dict=False)[0]
    got = load_transformer(exported)(**kw, return_dict=False)[0]
    scale = float(want.abs().max())
    own = float((want.double() - truth).abs().max()) / scale
    err = float((got.double() - truth).abs().max()) / scale
    assert 0 < err <= 4 * max(own, FP32_EPS), (err, own)


def test_no_mask_is_a_uniform_bias(exported):
    """attention_mask=None (no pipeline passes it): the graph's text mask is all ones, +1 on
    every score, which softmax cancels up to rounding: within the bound above of diffusers'
    unmasked forward."""
    from qkrope.runtime import load_transformer

    kw = _call(2, 3, 4, 6, seed=6)
    kw["attention_mask"] = None
    with torch.no_grad():
        want = chroma_transformer(0)(**kw, return_dict=False)[0]
    got = load_transformer(exported)(**kw, return_dict=False)[0]
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) / scale <= 8 * 4 * FP32_EPS


# --------------------------------------------------------------------------------------------
# The pipelines on the drop-in
# --------------------------------------------------------------------------------------------

#: The per-call error the pipelines' bound starts from, relative to max|output|: above the
#: test_onnxruntime_at_untraced_shapes bound (4 x diffusers' own fp32 error, measured <= 8e-7
#: relative: <= 3.2e-6), rounded up to 1e-5.
CHROMA_TRANSFORMER_PARITY = 1e-5


def _latent_bound(reference, cfg_scale):
    """Largest |latents - reference| the export may cause: each prediction within PARITY x its
    magnitude; a flow-matching Euler step adds (sigma_next - sigma) x prediction, the sigmas
    travel at most 1 in all (img2img / inpaint: less), so the latents carry at most that error;
    CFG (neg + s (pos - neg)) amplifies a prediction's error by at most 1 + 2 s. The
    predictions are of the latents' magnitude (unit-variance noise at the start)."""
    return CHROMA_TRANSFORMER_PARITY * (1 + 2 * max(cfg_scale, 1.0)) * float(
        reference.abs().max())


def _image(height, width, seed=0):
    from PIL import Image

    pixels = np.random.default_rng(seed).random((height, width, 3)) * 255
    return Image.fromarray(pixels.astype(np.uint8))


@pytest.mark.parametrize("cls_name", ["ChromaPipeline", "ChromaImg2ImgPipeline",
                                      "ChromaInpaintPipeline"])
def test_pipeline_end_to_end(exported, cls_name):
    """``pipe.transformer = load_transformer(...)``: two prompts (batch 2) with padded prompt
    masks of different lengths, CFG with a negative prompt, a 24 x 40 image (240 image tokens,
    6 text tokens: neither traced); the latents agree with the PyTorch pipeline's."""
    import _flux_models as fm

    from qkrope import model_io
    from qkrope.runtime import load_transformer

    cls = getattr(diffusers, cls_name)
    vae = fm.vae(fm.FLUX1)  # diffusers' Chroma pipeline-test VAE (FLUX.1's)
    pipes = [cls(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae,
                 text_encoder=None, tokenizer=None, transformer=chroma_transformer(0))
             for _ in range(2)]
    if cls_name == "ChromaInpaintPipeline":
        # it reads transformer.config.guidance_embeds, which diffusers' Chroma config lacks
        # (AttributeError); the drop-in's says False, the stock model is given the same
        pipes[0].transformer.register_to_config(guidance_embeds=False)
    pipes[1].transformer = load_transformer(exported)
    assert isinstance(pipes[1].transformer, ChromaTransformer)
    assert pipes[1].transformer.config.guidance_embeds is False
    g = torch.Generator().manual_seed(5)
    kw = dict(prompt_embeds=torch.randn(2, 6, 32, generator=g),
              negative_prompt_embeds=torch.randn(2, 6, 32, generator=g),
              prompt_attention_mask=torch.tensor([[1.0, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]]),
              negative_prompt_attention_mask=torch.tensor([[1.0, 1, 0, 0, 0, 0]] * 2),
              height=24, width=40, num_inference_steps=2, guidance_scale=4.0,
              output_type="latent")
    if cls_name != "ChromaPipeline":
        kw.update(image=_image(24, 40), strength=0.8)
    if cls_name == "ChromaInpaintPipeline":
        kw["mask_image"] = _image(24, 40, seed=1).convert("L")
    a, b = [p(**kw, generator=torch.Generator().manual_seed(0)).images for p in pipes]
    assert a.shape == b.shape and a.shape[0] == 2
    diff, bound = float((a - b).abs().max()), _latent_bound(a, 4.0)
    assert diff <= bound, f"latents differ by {diff:.3g} (bound {bound:.3g})"


# --------------------------------------------------------------------------------------------
# Refusals
# --------------------------------------------------------------------------------------------

def _refused(exported, match, **change):
    from qkrope.runtime import load_transformer

    kw = _call(2, 3, 4, 6, seed=7)
    kw.update(change)
    with pytest.raises(InputError, match=match) as exc:
        load_transformer(exported)(**kw)
    assert "\n" not in str(exc.value)
    return exc


def test_a_bool_mask_is_refused(exported):
    """diffusers drops keys for a bool mask (a different output); the graph adds the float
    mask the pipelines pass, so a bool one is refused rather than reinterpreted."""
    mask = _call(2, 3, 4, 6, seed=7)["attention_mask"] > 0
    _refused(exported, "diffusers' SDPA drops keys for a bool mask.*Fix", attention_mask=mask)


def test_a_masked_image_token_is_refused(exported):
    mask = _call(2, 3, 4, 6, seed=7)["attention_mask"].clone()
    mask[0, -1] = 0
    _refused(exported, "image part.*not all ones", attention_mask=mask)


def test_a_mask_of_another_shape_is_refused(exported):
    _refused(exported, r"attention_mask must be \[batch, txt_tokens \+ img_tokens\] = \[2, 18\]",
             attention_mask=torch.ones(2, 6))


def test_controlnet_ip_adapter_and_lora_scale_are_refused(exported):
    from qkrope.runtime import load_transformer

    _refused(exported, "ControlNet", controlnet_block_samples=[torch.zeros(1)])
    exc = _refused(exported, "IP-Adapter",
                   joint_attention_kwargs={"ip_adapter_image_embeds": [torch.zeros(1)]})
    assert isinstance(exc.value, IPAdapterUnsupportedError)
    _refused(exported, "LoRA scale other than 1", joint_attention_kwargs={"scale": 0.5})
    assert not hasattr(load_transformer(exported), "encoder_hid_proj")


def test_another_familys_arguments_are_refused_by_name(exported):
    """FLUX.1's pooled projections: the family whose pipelines pass it is named."""
    _refused(exported, r"received pooled_projections, which FLUX\.1 / FLUX\.2[^']*'s pipelines pass",
             pooled_projections=torch.zeros(2, 32))


# --------------------------------------------------------------------------------------------
# The tools
# --------------------------------------------------------------------------------------------

def test_check_against_diffusers_forward(exported, tmp_path):
    """`qkrope check`: ONNX Runtime vs diffusers' own forward on the pipelines' ids and mask
    (make_inputs pads the second item's text)."""
    from qkrope.apps.check import check_model

    out = io.StringIO()
    passed, rows = check_model(exported, workdir=tmp_path, out=out)
    assert passed, out.getvalue()
    assert [(r.runner, r.against, r.output) for r in rows] == [("onnxrt", "pytorch", "sample")]
    assert 0 < rows[0].max_abs


def _compared(text: str) -> list[str]:
    return [line.split()[2] for line in text.splitlines() if line.startswith("onnxrt")]


def test_layers_and_blocks(exported, tmp_path, capsys):
    """Issue 35: `check --blocks` compares block 0's image/text outputs and block 1's joined
    stream; `check --layers 1` the first block of the whole export (the graph cut after it);
    `export --layers 1` keeps it with the whole model's modulation rows, which its whole-model
    check (the reference's single block passing its stream through) and a check --layers 1
    compare. diffusers' forward finds a block's modulation rows at offsets counted from every
    block, so a reference built with fewer blocks reads other rows: these checks fail on it."""
    from qkrope.cli import main
    from qkrope.sidecars import ModelInfo

    for flags, expected in ((["--blocks"], ["sample", "block0.img", "block0.txt",
                                            "block1.joined"]),
                            (["--layers", "1"], ["block0.img", "block0.txt"])):
        assert main(["check", str(exported), *flags, "--workdir", str(tmp_path / flags[-1])]) == 0
        text = capsys.readouterr().out
        assert _compared(text) == expected, (flags, text)
    out = tmp_path / "chroma-l1.onnx"
    assert main(["export", "--model", "transformer", "--diffusers",
                 str(exported.parent / "chroma-diffusers"), "--layers", "1", "--out",
                 str(out)]) == 0
    assert ModelInfo.load(out).config.num_layers_exported == 1
    assert "1 of 1 double + 0 of 1 single blocks" in capsys.readouterr().err
    for flags, expected in (([], ["sample"]), (["--layers", "1"], ["block0.img", "block0.txt"])):
        assert main(["check", str(out), *flags, "--workdir", str(tmp_path / f"l1{flags}")]) == 0
        text = capsys.readouterr().out
        assert _compared(text) == expected, (flags, text)


def test_make_inputs_feeds_the_float_mask_and_the_pipelines_caches(exported):
    from qkrope.runtime.inputs import make_inputs
    from qkrope.sidecars import ModelInfo

    info = ModelInfo.load(exported)
    feeds = make_inputs(info, [(1, 3, 5)], 6, 2)
    assert list(feeds) == info.input_names
    mask = feeds["encoder_hidden_states_mask"]
    assert mask.dtype == np.float32 and mask.shape == (2, 6) and mask.min() == 0
    want = caches_from_ids(*sample_ids([(1, 3, 5)], 6), axes_dims=(4, 4, 8),
                           theta=CHROMA.theta, head_dim=16)
    assert np.array_equal(feeds["img_cos_sin_cache"], want.img.numpy())
    assert np.array_equal(feeds["txt_cos_sin_cache"], want.txt.numpy())


def test_triton_repo_composes_to_the_checked_model(exported, tmp_path, monkeypatch, capsys):
    """The ensemble over the ONNX export: clients send txt_ids / img_ids (3 axes) in place of
    the caches and the float text mask as is; the rope model's caches for the pipelines' ids,
    fed with the other inputs to the repository's ONNX model, give ONNX Runtime's output on
    make_inputs' feeds bit for bit (the model `qkrope check` compared with diffusers)."""
    pytest.importorskip("tritonclient", reason="requires tritonclient (pip install -e '.[test]')")
    from _triton_helpers import Tensor, ids_repository, serves_the_same_step

    from qkrope.runtime.inputs import make_inputs

    repo = tmp_path / "repo"
    info, caches, inputs = ids_repository(exported, repo, "chroma", capsys)
    assert ("encoder_hidden_states_mask", "TYPE_FP32", [-1, -1]) in inputs
    shapes, txt, batch = [(1, 3, 5)], 6, 2
    feeds = make_inputs(info, shapes, txt, batch)
    txt_ids, img_ids = sample_ids(shapes, txt)
    serves_the_same_step(repo, "chroma", monkeypatch, [
        Tensor("txt_ids", txt_ids), Tensor("img_ids", img_ids),
        Tensor("hidden_states", feeds["hidden_states"]),
        Tensor("encoder_hidden_states", feeds["encoder_hidden_states"]),
        Tensor("encoder_hidden_states_mask", feeds["encoder_hidden_states_mask"])],
        feeds, caches, exported)
