"""Tiny random FLUX.1 / FLUX.2 transformers, VAEs and their exports for the FLUX tests (built in
code, nothing downloaded). The sizes are diffusers' own test configs (tests/models/transformers/
test_models_transformer_flux.py, test_models_transformer_flux2.py: 2 heads x 16, text width 32,
RoPE axes (4, 4, 8) / (4, 4, 4, 4)); FLUX.1 dev has 2 double + 2 single blocks (6 nodes), the
others 1 + 1. Each variant is exported once per test session (:func:`exported`)."""

from __future__ import annotations

from pathlib import Path

import torch

import diffusers

from qkrope import families
from qkrope.families.flux import tiny as flux_tiny
from qkrope.families._record import FamilyRecord

#: The bound the FLUX drop-in's per-call error is held to, relative to max|output| (the
#: pipeline tests' latent bound starts from it): at least twice the stock export's own error,
#: which test_flux_export.py's test_ort_at_untraced_shapes measures and asserts to be below it
#: (on the 2-core EPYC: 6.8e-5 of max|output| for FLUX.1, 1.4e-4 for FLUX.2, ours within 1e-6
#: of the stock's), rounded up to 5e-4.
#: The FLUX.1 and FLUX.2 records (the registry's).
FLUX1, FLUX2 = families.by_name("flux1"), families.by_name("flux2")
FLUX_TRANSFORMER_PARITY = 5e-4

#: variant -> (family, diffusers class, config): the configs live in the family's tiny
#: pipeline recipe (qkrope.families.flux.tiny)
VARIANTS = {v: (families.by_name(name), getattr(diffusers, cls), config)
            for v, (name, cls, config) in flux_tiny.VARIANTS.items()}
#: a tiny random FLUX transformer of a variant (weights of a non-trivial scale: diffusers' init
#: zeroes the modulations and the output projection; RMSNorm weights near 1 but not all 1)
transformer = flux_tiny.transformer


_SAVED: dict[tuple[str, str], Path] = {}


def saved(variant: str, root: Path) -> Path:
    """The variant's folder (save_pretrained), once per session."""
    key = (variant, str(root))
    if key not in _SAVED:
        folder = root / f"{variant}-diffusers"
        transformer(variant).save_pretrained(str(folder))
        _SAVED[key] = folder
    return _SAVED[key]


_EXPORTED: dict[tuple[str, str], Path] = {}


def exported(variant: str, root: Path) -> Path:
    """``qkrope export --model transformer --diffusers <variant folder>``, once per session."""
    from qkrope.cli import main

    key = (variant, str(root))
    if key not in _EXPORTED:
        out = root / f"{variant}.onnx"
        assert main(["export", "--model", "transformer", "--diffusers",
                     str(saved(variant, root)), "--out", str(out)]) == 0
        _EXPORTED[key] = out
    return _EXPORTED[key]


def vae(family: FamilyRecord):
    """diffusers' pipeline-test VAE sizes (qkrope.families.flux.tiny.vae): one level
    (vae_scale_factor 1), 1 latent channel, so that 2x2 packing gives the transformer's 4 input
    channels."""
    return flux_tiny.vae(family.name)


def ids(family: FamilyRecord, img_shapes, txt_len: int):
    """Position ids as the FLUX pipelines make them (the exporter's sample ids)."""
    from qkrope.families.flux.export import sample_ids

    return sample_ids(family, img_shapes, txt_len)


# --------------------------------------------------------------------------------------------
# The dual-stream clones (LongCat-Image, Ovis-Image, ...): the checks every clone's test file
# runs on its tiny transformer, with its record and its DualStream
# --------------------------------------------------------------------------------------------

def clone_inputs(spec, cfg, img_shapes, txt_len: int, batch: int, seed: int = 0) -> dict:
    """diffusers' forward arguments of a clone (the ids its pipelines lay out) for a sample."""
    from qkrope.runtime.dual_stream import sample_ids

    txt_ids, img_ids = (torch.from_numpy(a) for a in sample_ids(spec.ids, img_shapes, txt_len))
    g = torch.Generator().manual_seed(seed)
    return dict(hidden_states=torch.randn(batch, img_ids.shape[0], cfg["in_channels"],
                                          generator=g),
                encoder_hidden_states=torch.randn(batch, txt_len, cfg["joint_attention_dim"],
                                                  generator=g),
                timestep=torch.rand(batch, generator=g), img_ids=img_ids, txt_ids=txt_ids)


def clone_caches(record, model, kw):
    """The caches of ``kw``'s ids for ``model`` (the shared builder)."""
    from qkrope.runtime.dual_stream import caches_from_ids

    cfg = model.config
    return caches_from_ids(record.short, kw["txt_ids"], kw["img_ids"],
                           axes_dims=cfg["axes_dims_rope"], theta=model.pos_embed.theta,
                           head_dim=cfg["attention_head_dim"])


def clone_wrapped(record, spec, model, kw, layers=None):
    """The shared cache-input wrapper's output for diffusers' arguments ``kw``."""
    from qkrope.export.dual_stream import CacheInputTransformer, cache_input

    caches = clone_caches(record, model, kw)
    wrapper = cache_input(CacheInputTransformer, model, record, spec,
                          record.kept_blocks(model.config, layers), rounding=record.rounding)
    with torch.no_grad():
        return wrapper(kw["hidden_states"], kw["encoder_hidden_states"], kw["timestep"],
                       caches.img, caches.txt)


_CLONE_EXPORTS: dict[tuple[str, str], Path] = {}


def clone_exported(builder, root: Path) -> Path:
    """``qkrope export --model transformer`` of a tiny builder's folder, once per session."""
    from qkrope.cli import main

    key = (builder.variant, str(root))
    if key not in _CLONE_EXPORTS:
        out = root / f"{builder.variant}.onnx"
        assert main(["export", "--model", "transformer", "--diffusers",
                     str(builder.saved(root)), "--out", str(out)]) == 0
        _CLONE_EXPORTS[key] = out
    return _CLONE_EXPORTS[key]


def clone_ort_error(record, model, onnx_path: Path, kw) -> tuple[float, float]:
    """(max |ONNX Runtime - diffusers' fp32 forward|, max |diffusers' fp32 forward|) for
    ``kw`` (the caches in place of the ids)."""
    import numpy as np
    import onnxruntime as ort

    caches = clone_caches(record, model, kw)
    with torch.no_grad():
        ref = model(**kw, return_dict=False)[0].numpy()
    feeds = {k: v.numpy() for k, v in kw.items() if k not in ("img_ids", "txt_ids")}
    feeds.update(img_cos_sin_cache=caches.img.numpy(), txt_cos_sin_cache=caches.txt.numpy())
    got = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"]).run(
        None, feeds)[0]
    assert got.shape == ref.shape
    return float(np.abs(got - ref).max()), float(np.abs(ref).max())


def clone_bit_exact(builder, record, spec, dtype) -> None:
    """The shared wrapper on a clone's tiny model equals diffusers' forward bit for bit on two
    items, an untraced 3 x 5 image and 7 text tokens, in fp32. In fp16 / bf16 the whole model
    is not (diffusers' unmasked SDPA picks a fused CPU kernel that rounds otherwise than the
    softmax attention the graph computes), so there the check is the node's own claim: each
    attention's q after its ``norm_q`` and diffusers' ``apply_rotary_emb`` with the model's
    ``pos_embed`` tables, bit for bit the fused op in the record's rounding."""
    from diffusers.models.embeddings import apply_rotary_emb

    from qkrope.export.ops import qk_norm_rope

    model = builder.build(0).to(dtype).eval()
    kw = clone_inputs(spec, model.config, [(1, 3, 5)], 7, 2, seed=3)
    if dtype == torch.float32:
        with torch.no_grad():
            want = model(**kw, return_dict=False)[0]
        got = clone_wrapped(record, spec, model, kw)
        assert torch.equal(got, want), float((got - want).abs().max())
        return
    caches = clone_caches(record, model, kw)
    tables = model.pos_embed(kw["img_ids"])
    heads, head_dim = model.config["num_attention_heads"], model.config["attention_head_dim"]
    g = torch.Generator().manual_seed(0)
    for block in list(model.transformer_blocks) + list(model.single_transformer_blocks):
        norm = block.attn.norm_q
        q = (torch.randn(2, kw["img_ids"].shape[0], heads, head_dim, generator=g) * 3).to(dtype)
        with torch.no_grad():
            want = apply_rotary_emb(norm(q), tables, sequence_dim=1)
            got, _ = qk_norm_rope(q, q, norm.weight, norm.weight, caches.img, eps=norm.eps,
                                  rounding=record.rounding)
        assert torch.equal(got, want), dtype
