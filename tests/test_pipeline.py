"""A diffusers Qwen-Image pipeline runs on the exported transformer with nothing else changed:
``pipe.transformer = qkrope.runtime.load_transformer("transformer.onnx")``.

The tiny random QwenImagePipeline of qkrope.apps.tiny_pipeline (built in code, text encoder
bypassed with prompt embeddings, nothing downloaded) runs twice from the same seed: with the
PyTorch transformer and with its ONNX export through ONNX Runtime. The latents must agree within
tiny_pipeline.latent_bound, whose derivation is written beside it.
"""

from __future__ import annotations

import pytest
import torch

diffusers = pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")
pytest.importorskip("transformers", reason="QwenImagePipeline requires transformers (test extras)")

from qkrope.apps import tiny_pipeline as tp  # noqa: E402
from qkrope.cli import main  # noqa: E402
from qkrope.errors import InputError  # noqa: E402
from qkrope.runtime import load_transformer  # noqa: E402
from qkrope.runtime.transformer import TransformerLoadError  # noqa: E402

CONFIG = tp.TRANSFORMER_CONFIG


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from _tiny_model import export_tiny_transformer

    transformer = tp.tiny_transformer()
    _, onnx = export_tiny_transformer(tmp_path_factory.mktemp("pipeline"), transformer=transformer)
    return transformer, tp.tiny_vae(), onnx


def _pipelines(models, edit=False):
    transformer, vae, onnx_path = models
    ref = tp.pipeline(transformer, vae, edit=edit)
    ours = tp.pipeline(transformer, vae, edit=edit)
    ours.transformer = load_transformer(onnx_path)  # the one line a user writes
    return ref, ours


_embeds = tp.prompt_embeds


def _run_both(ref, ours, **kw):
    kw.setdefault("num_inference_steps", 2)
    out = []
    for pipe in (ref, ours):
        out.append(pipe(**kw, output_type="latent", generator=torch.Generator().manual_seed(0)).images)
    return out


def _assert_close(got, want, cfg_scale=1.0):
    assert got.shape == want.shape
    bound = tp.latent_bound(want, cfg_scale)
    diff = float((got - want).abs().max())
    assert diff <= bound, f"latents differ by {diff:.3g} (bound {bound:.3g})"


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


def test_edit_pipeline_with_a_condition_image(models, monkeypatch):
    """QwenImageEditPipeline: the condition image's latents join the generated image's tokens
    (img_shapes of two images per batch item, the second at frame offset 1)."""
    import numpy as np
    from PIL import Image

    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit as edit

    # the pipeline resizes the condition image to ~1024x1024 first; keep it tiny for a tiny model
    monkeypatch.setattr(edit, "calculate_dimensions", lambda area, ratio: (56, 40, None))
    ref, ours = _pipelines(models, edit=True)
    image = Image.fromarray((np.random.default_rng(0).random((40, 56, 3)) * 255).astype(np.uint8))
    pe, pm = _embeds(1, 6, seed=5)
    a, b = _run_both(ref, ours, image=image, prompt_embeds=pe, prompt_embeds_mask=pm, height=32,
                     width=48)
    _assert_close(b, a)
