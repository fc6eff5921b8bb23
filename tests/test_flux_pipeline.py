"""diffusers' FLUX pipelines run on the exported transformer with nothing else changed:
``pipe.transformer = qkrope.runtime.load_transformer("flux.onnx")``, the caches built from the
txt_ids/img_ids each call is given. Tiny random pipelines (tests/_flux_models.py; text encoders
bypassed with prompt embeddings, nothing downloaded) run from one seed with the PyTorch
transformer and with its export through ONNX Runtime; the latents must agree within
:func:`latent_bound`. What the graph cannot honour is refused in one line.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

diffusers = pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")
pytest.importorskip("transformers", reason="diffusers' FLUX pipelines import transformers")

import _flux_models as fm  # noqa: E402

from qkrope.errors import InputError  # noqa: E402
from qkrope.runtime import load_transformer  # noqa: E402
from qkrope.families.flux.dropin import FluxTransformer, IPAdapterUnsupportedError  # noqa: E402


def latent_bound(reference: torch.Tensor, cfg_scale: float = 1.0) -> float:
    """Largest |latents - reference| the export may cause: each call's prediction is within
    fm.FLUX_TRANSFORMER_PARITY x its magnitude (test_flux_export.py asserts it); a flow-matching
    Euler step adds (sigma_next - sigma) x prediction and the sigmas travel at most 1 in total,
    so the latents carry at most that error over all steps; true CFG (neg + s (pos - neg))
    amplifies a prediction's error by at most 1 + 2 s. The predictions are of the latents'
    magnitude (unit-variance noise at the start)."""
    return float(fm.FLUX_TRANSFORMER_PARITY * (1 + 2 * max(cfg_scale, 1.0))
                 * reference.abs().max())


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.getbasetemp()


def _pipelines(root, variant, cls, **extra):
    family = fm.VARIANTS[variant][0]
    transformer = fm.transformer(variant)
    vae = fm.vae(family)
    encoders = dict(text_encoder=None, tokenizer=None)
    if family is fm.FLUX1:
        encoders.update(text_encoder_2=None, tokenizer_2=None)
    pipes = [cls(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae,
                 transformer=transformer, **encoders, **extra) for _ in range(2)]
    pipes[1].transformer = load_transformer(fm.exported(variant, root))  # the user's one line
    assert isinstance(pipes[1].transformer, FluxTransformer)
    return pipes


def _run_both(pipes, **kw):
    kw.setdefault("num_inference_steps", 2)
    return [p(**kw, output_type="latent", generator=torch.Generator().manual_seed(0)).images
            for p in pipes]


def _assert_close(got, want, cfg_scale=1.0):
    assert got.shape == want.shape
    bound = latent_bound(want, cfg_scale)
    diff = float((got - want).abs().max())
    assert diff <= bound, f"latents differ by {diff:.3g} (bound {bound:.3g})"


def _embeds(batch, tokens, seed, pooled=True):
    g = torch.Generator().manual_seed(seed)
    out = {"prompt_embeds": torch.randn(batch, tokens, 32, generator=g)}
    if pooled:
        out["pooled_prompt_embeds"] = torch.randn(batch, 32, generator=g)
    return out


def _image(height, width, seed=0):
    from PIL import Image

    pixels = np.random.default_rng(seed).random((height, width, 3)) * 255
    return Image.fromarray(pixels.astype(np.uint8))


def test_flux1_dev_with_true_cfg(root):
    """FluxPipeline, a guidance-distilled model (guidance input), a non-square image and true
    CFG with a negative prompt (the two predictions must be separate tensors)."""
    pipes = _pipelines(root, "flux1-dev", diffusers.FluxPipeline)
    neg = _embeds(1, 7, seed=2)
    a, b = _run_both(pipes, **_embeds(1, 7, seed=1), guidance_scale=3.5, height=16, width=24,
                     negative_prompt_embeds=neg["prompt_embeds"],
                     negative_pooled_prompt_embeds=neg["pooled_prompt_embeds"],
                     true_cfg_scale=2.0)
    _assert_close(b, a, cfg_scale=2.0)


def test_flux1_schnell_two_images_per_prompt(root):
    pipes = _pipelines(root, "flux1-schnell", diffusers.FluxPipeline)
    a, b = _run_both(pipes, **_embeds(1, 6, seed=3), num_images_per_prompt=2, height=16,
                     width=16)
    assert a.shape[0] == 2
    _assert_close(b, a)


def test_flux1_kontext_with_a_condition_image(root):
    """FluxKontextPipeline: the condition image's tokens join the image stream with first
    position axis 1."""
    pipes = _pipelines(root, "flux1-dev", diffusers.FluxKontextPipeline)
    a, b = _run_both(pipes, **_embeds(1, 6, seed=4), image=_image(24, 16), height=16, width=16,
                     guidance_scale=2.5, _auto_resize=False, max_area=16 * 24)
    _assert_close(b, a)


def test_flux2_dev_with_a_reference_image(root):
    """Flux2Pipeline (dev: guidance input), text at FLUX.2's 4-axis positions, a reference
    image's tokens appended to the image stream."""
    pipes = _pipelines(root, "flux2-dev", diffusers.Flux2Pipeline)
    a, b = _run_both(pipes, **_embeds(1, 7, seed=5, pooled=False), image=[_image(64, 64)],
                     guidance_scale=4.0, height=16, width=16)  # (the pipeline's least size)
    _assert_close(b, a)


def test_flux2_klein(root):
    """Flux2KleinPipeline (klein: no guidance embeddings; the pipeline passes guidance=None),
    classifier-free guidance with a negative prompt of another length."""
    if not hasattr(diffusers, "Flux2KleinPipeline"):
        pytest.skip("requires diffusers with Flux2KleinPipeline")
    pipes = _pipelines(root, "flux2-klein", diffusers.Flux2KleinPipeline)
    neg = _embeds(1, 4, seed=7, pooled=False)["prompt_embeds"]
    a, b = _run_both(pipes, **_embeds(1, 6, seed=6, pooled=False), height=16, width=24,
                     negative_prompt_embeds=neg, guidance_scale=3.0)
    _assert_close(b, a, cfg_scale=3.0)


# --------------------------------------------------------------------------------------------
# Attributes and refusals
# --------------------------------------------------------------------------------------------

def _call_args(variant):
    family, _, cfg = fm.VARIANTS[variant]
    txt_ids, img_ids = fm.ids(family, [(1, 4, 4)], 5)
    kw = dict(hidden_states=torch.randn(1, 16, 4), encoder_hidden_states=torch.randn(1, 5, 32),
              timestep=torch.tensor([0.5]), img_ids=img_ids, txt_ids=txt_ids,
              return_dict=False)
    if family is fm.FLUX1:
        kw["pooled_projections"] = torch.randn(1, 32)
    if cfg["guidance_embeds"]:
        kw["guidance"] = torch.tensor([3.5])
    return kw


def test_drop_in_attributes(root):
    t = load_transformer(fm.exported("flux1-dev", root))
    assert t.config.in_channels == 4 and t.config["guidance_embeds"] is True
    assert t.dtype == torch.float32 and t.device == torch.device("cpu")
    assert not hasattr(t, "encoder_hid_proj")  # no IP-Adapter: diffusers' loaders see none
    with t.cache_context("cond"):
        pass
    kw = _call_args("flux1-dev")
    out = t(**kw)[0]
    assert out.shape == (1, 16, 4) and t(**kw)[0] is not out  # the caller owns each result
    assert t(**{**kw, "return_dict": True}).sample.shape == out.shape
    # diffusers' batched ids ([batch, tokens, axes], FLUX.2's form) and a scalar timestep
    batched = {**kw, "img_ids": kw["img_ids"][None], "txt_ids": kw["txt_ids"][None],
               "timestep": torch.tensor(0.5)}
    assert torch.equal(t(**batched)[0], out)
    assert torch.equal(t(**{**kw, "joint_attention_kwargs": {"scale": 1.0}})[0], out)


@pytest.mark.parametrize("variant,bad,error,match", [
    ("flux1-dev", dict(controlnet_block_samples=[torch.zeros(1, 16, 32)]), InputError,
     "ControlNet"),
    ("flux1-dev", dict(controlnet_single_block_samples=[torch.zeros(1, 21, 32)]), InputError,
     "ControlNet"),
    ("flux1-dev", dict(joint_attention_kwargs={"ip_adapter_image_embeds": [torch.zeros(1)]}),
     IPAdapterUnsupportedError, "IP-Adapter"),
    ("flux1-dev", dict(joint_attention_kwargs={"scale": 0.5}), InputError, "LoRA scale"),
    ("flux1-dev", dict(guidance=None), InputError, "needs guidance"),
    ("flux1-schnell", dict(guidance=torch.tensor([3.5])), InputError,
     "without guidance embeddings"),
    ("flux2-klein", dict(kv_cache_mode="extract", num_ref_tokens=16), InputError, "KV cache"),
    ("flux2-klein", dict(kv_cache=object(), kv_cache_mode="cached"), InputError, "KV cache"),
    ("flux1-dev", dict(img_ids=torch.zeros(15, 3)), InputError, "img_ids must be"),
    ("flux2-klein", dict(txt_ids=torch.zeros(5, 3)), InputError, "txt_ids must be"),
    ("flux1-dev", dict(pooled_projections=None), InputError, "pooled_projections"),
])
def test_refusals(root, variant, bad, error, match):
    t = load_transformer(fm.exported(variant, root))
    with pytest.raises(error, match=match) as exc:
        t(**{**_call_args(variant), **bad})
    assert "\n" not in str(exc.value)


def test_ids_must_be_the_same_for_every_batch_item(root):
    t = load_transformer(fm.exported("flux2-klein", root))
    kw = _call_args("flux2-klein")
    ids = torch.stack([kw["img_ids"], kw["img_ids"] + 1])
    with pytest.raises(InputError, match="differs between batch items"):
        t(**{**kw, "hidden_states": torch.randn(2, 16, 4),
             "encoder_hidden_states": torch.randn(2, 5, 32), "img_ids": ids})


def test_ip_adapter_pipeline_is_refused(root):
    """FluxPipeline asks the transformer for its IP-Adapter projection when given an
    ip_adapter_image: the drop-in answers with the refusal, not an AttributeError."""
    pipes = _pipelines(root, "flux1-schnell", diffusers.FluxPipeline)
    with pytest.raises(IPAdapterUnsupportedError, match="IP-Adapter"):
        pipes[1](**_embeds(1, 6, seed=3), ip_adapter_image=_image(16, 16), height=16, width=16,
                 num_inference_steps=1, output_type="latent")


def test_runner_takes_flux_conditioning_by_role(root):
    """The runner under the drop-in: pooled_projections and guidance by role, each one the model
    has required, one it lacks refused."""
    from qkrope.runtime import RunnerInputError, load
    from qkrope.families.flux.dropin import caches_from_ids

    family = fm.FLUX1
    runner = load(fm.exported("flux1-dev", root))
    txt_ids, img_ids = fm.ids(family, [(1, 4, 4)], 5)
    caches = caches_from_ids(family.name, txt_ids, img_ids, axes_dims=(4, 4, 8), theta=10000,
                             head_dim=16)
    args = (torch.randn(1, 16, 4), torch.randn(1, 5, 32), caches, None, torch.tensor([0.5]))
    full = {"pooled_projections": torch.randn(1, 32), "guidance": torch.tensor([3.5])}
    assert runner(*args, conditioning=full).shape == (1, 16, 4)
    with pytest.raises(RunnerInputError, match="needs guidance"):
        runner(*args, conditioning={"pooled_projections": full["pooled_projections"]})
    with pytest.raises(RunnerInputError, match="takes the roles"):
        runner(*args, conditioning={**full, "mask": torch.ones(1, 5)})
    with pytest.raises(RunnerInputError, match="extra_inputs may not replace it"):
        runner(*args, conditioning=full, extra_inputs={"guidance": full["guidance"]})
    klein = load(fm.exported("flux2-klein", root))
    with pytest.raises(RunnerInputError, match="has no guidance input"):
        klein(*args, conditioning={"guidance": full["guidance"]})
