"""A diffusers Qwen-Image pipeline runs on the exported transformer with nothing else changed:
``pipe.transformer = qkrope.runtime.load_transformer("transformer.onnx")``.

A tiny random QwenImagePipeline is built in code (tiny QwenImageTransformer2DModel, tiny
AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler; the text encoder is bypassed with
prompt_embeds / prompt_embeds_mask; nothing is downloaded) and run twice from the same seed: with
the PyTorch transformer and with its ONNX export through ONNX Runtime.

Bound on the latents, derived: the exported transformer's output differs from diffusers' by the
fp32 summation orders of ONNX Runtime's and PyTorch's kernels, <= 1e-4 x max|output|
(tests/test_transformer_export.py). A flow-matching Euler step adds (sigma_next - sigma) x output
to the latents and the sigmas travel at most 1 in total, so the latents carry at most that error
over all steps; true CFG combines two predictions as neg + s (pos - neg), which amplifies an error
by at most (1 + 2 s) before diffusers rescales it to the conditional prediction's norm. The
predictions are of the latents' magnitude (unit-variance noise at the start), so
|latents - reference| <= 1e-4 (1 + 2 s) max|reference| with s = 1 without true CFG.
"""

from __future__ import annotations

import pytest
import torch

diffusers = pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")
pytest.importorskip("transformers", reason="QwenImagePipeline requires transformers (test extras)")

from qkrope.cli import main  # noqa: E402
from qkrope.errors import InputError  # noqa: E402
from qkrope.runtime import load_transformer  # noqa: E402
from qkrope.runtime.transformer import TransformerLoadError  # noqa: E402

CONFIG = dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=32,
              num_attention_heads=2, joint_attention_dim=24, axes_dims_rope=(8, 12, 12))
PARITY = 1e-4  # the transformer's ORT-vs-PyTorch bound (module docstring)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    torch.manual_seed(0)
    transformer = diffusers.QwenImageTransformer2DModel(**CONFIG)
    with torch.no_grad():
        for name, p in transformer.named_parameters():  # non-trivial weights
            p.copy_(torch.randn_like(p) * (0.2 if p.dim() > 1 else 0.05)
                    + (1.0 if p.dim() == 1 and "norm" in name else 0.0))
    transformer.eval()
    d = tmp_path_factory.mktemp("pipeline")
    transformer.save_pretrained(str(d / "transformer"))
    assert main(["export", "--model", "transformer", "--diffusers", str(d / "transformer"),
                 "--out", str(d / "transformer.onnx")]) == 0
    vae = diffusers.AutoencoderKLQwenImage(
        base_dim=24, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1, temperal_downsample=[False, True],
        latents_mean=[0.0] * 4, latents_std=[1.0] * 4).eval()
    return transformer, vae, d / "transformer.onnx"


def _pipelines(models, cls=None):
    transformer, vae, onnx_path = models
    cls = cls or diffusers.QwenImagePipeline
    extra = {"processor": None} if cls is diffusers.QwenImageEditPipeline else {}
    make = lambda t: cls(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae,  # noqa: E731
                         text_encoder=None, tokenizer=None, transformer=t, **extra)
    ref = make(transformer)
    ours = make(transformer)
    ours.transformer = load_transformer(onnx_path)  # the one line a user writes
    return ref, ours


def _embeds(batch, tokens, seed, *, pad=0):
    g = torch.Generator().manual_seed(seed)
    embeds = torch.randn(batch, tokens, CONFIG["joint_attention_dim"], generator=g)
    mask = torch.ones(batch, tokens, dtype=torch.long)
    if pad:
        mask[-1, tokens - pad:] = 0  # the last prompt is shorter (padded)
    return embeds, mask


def _run_both(ref, ours, **kw):
    kw.setdefault("num_inference_steps", 2)
    out = []
    for pipe in (ref, ours):
        out.append(pipe(**kw, output_type="latent", generator=torch.Generator().manual_seed(0)).images)
    return out


def _assert_close(got, want, cfg_scale=1.0):
    assert got.shape == want.shape
    bound = PARITY * (1 + 2 * cfg_scale) * want.abs().max()
    diff = (got - want).abs().max()
    assert diff <= bound, f"latents differ by {float(diff):.3g} (bound {float(bound):.3g})"


@pytest.mark.parametrize("height, width", [(32, 32), (32, 48)], ids=["square", "non-square"])
def test_one_prompt(models, height, width):
    ref, ours = _pipelines(models)
    pe, pm = _embeds(1, 7, seed=1)
    a, b = _run_both(ref, ours, prompt_embeds=pe, prompt_embeds_mask=pm, height=height, width=width)
    _assert_close(b, a)


def test_true_cfg_with_a_negative_prompt(models):
    """The conditional and unconditional predictions must be separate tensors: with a reused
    output buffer the CFG combination silently collapses."""
    ref, ours = _pipelines(models)
    pe, pm = _embeds(1, 7, seed=2)
    ne, nm = _embeds(1, 5, seed=3)
    a, b = _run_both(ref, ours, prompt_embeds=pe, prompt_embeds_mask=pm, negative_prompt_embeds=ne,
                     negative_prompt_embeds_mask=nm, true_cfg_scale=4.0, height=32, width=32)
    _assert_close(b, a, cfg_scale=4.0)


def test_two_prompts_of_different_lengths_and_two_images_each(models):
    ref, ours = _pipelines(models)
    pe, pm = _embeds(2, 8, seed=4, pad=3)
    a, b = _run_both(ref, ours, prompt_embeds=pe, prompt_embeds_mask=pm, num_images_per_prompt=2,
                     height=32, width=32)
    assert a.shape[0] == 4
    _assert_close(b, a)


def test_drop_in_attributes_and_refusals(models):
    _, _, onnx_path = models
    t = load_transformer(onnx_path)
    assert t.config.in_channels == CONFIG["in_channels"] and t.config["guidance_embeds"] is False
    assert t.dtype == torch.float32 and t.device == torch.device("cpu")
    with t.cache_context("cond"):
        pass
    hs = torch.randn(1, 16, CONFIG["in_channels"])
    ehs = torch.randn(1, 4, CONFIG["joint_attention_dim"])
    kw = dict(hidden_states=hs, encoder_hidden_states=ehs, timestep=torch.tensor([0.5]),
              img_shapes=[[(1, 4, 4)]], return_dict=False)
    out = t(**kw)[0]
    assert out.shape == (1, 16, 16) and t(**kw)[0] is not out  # the caller owns each result
    assert t(**{**kw, "return_dict": True}).sample.shape == out.shape
    for bad, match in ((dict(guidance=torch.tensor([3.5])), "guidance"),
                       (dict(attention_kwargs={"scale": 0.5}), "LoRA"),
                       (dict(controlnet_block_samples=[hs]), "ControlNet"),
                       (dict(img_shapes=[[(1, 4, 5)]]), "image tokens"),
                       (dict(img_shapes=[[(1, 4, 4)], [(1, 2, 8)]]), "different images")):
        with pytest.raises(InputError, match=match):
            t(**{**kw, **bad})
    assert t(**{**kw, "attention_kwargs": {}})[0].shape == out.shape  # diffusers' default


def test_attention_block_is_not_a_transformer(tmp_path):
    out = tmp_path / "attn.onnx"
    assert main(["export", "--heads", "2", "--head-dim", "16", "--out", str(out)]) == 0
    with pytest.raises(TransformerLoadError, match="not an exported diffusers transformer"):
        load_transformer(out)
