"""Tiny HunyuanVideo-1.5 and HunyuanVideo transformers at diffusers' own test sizes
(tests/models/transformers/test_models_transformer_hunyuan_1_5.py and
test_models_transformer_hunyuan_video.py in diffusers), built in code, and their forward
inputs. The weights are random at a non-trivial scale (diffusers' init zeroes the modulations
and the output projection), RMSNorm weights near 1 but not all 1."""

from __future__ import annotations

import torch

from qkrope.families.hunyuan_video import tiny as hv_tiny

#: variant -> (the diffusers class name, its config), and the tiny random transformer of a
#: variant: they live in the family's tiny pipeline recipe
VARIANTS, transformer = hv_tiny.VARIANTS, hv_tiny.transformer


def inputs(variant: str, *, batch: int = 2, frames: int = 3, height: int = 4, width: int = 6,
           txt: int = 7, txt2: int = 5, image: int = 3, i2v: bool = False, seed: int = 3,
           dtype: torch.dtype = torch.float32) -> dict:
    """diffusers' forward keywords for a latent of ``frames x height x width`` (patch 1), with
    padded text in the last batch item (and padded ByT5 tokens in the first)."""
    _, cfg = VARIANTS[variant]
    g = torch.Generator().manual_seed(seed)
    out = dict(hidden_states=torch.randn(batch, cfg["in_channels"], frames, height, width,
                                         generator=g).to(dtype),
               timestep=torch.linspace(900.0, 100.0, batch).to(dtype),
               encoder_hidden_states=torch.randn(batch, txt, cfg["text_embed_dim"],
                                                 generator=g).to(dtype))
    mask = torch.ones(batch, txt)
    mask[-1, txt // 2:] = 0
    out["encoder_attention_mask"] = mask
    if variant == "hunyuan-video-1.5":
        mask_2 = torch.ones(batch, txt2)
        mask_2[0, txt2 // 2:] = 0
        out.update(encoder_hidden_states_2=torch.randn(batch, txt2, cfg["text_embed_2_dim"],
                                                       generator=g).to(dtype),
                   encoder_attention_mask_2=mask_2,
                   image_embeds=(torch.randn(batch, image, cfg["image_embed_dim"], generator=g)
                                 if i2v else torch.zeros(batch, image,
                                                         cfg["image_embed_dim"])).to(dtype))
    else:
        out.update(pooled_projections=torch.randn(batch, cfg["pooled_projection_dim"],
                                                  generator=g).to(dtype),
                   guidance=torch.full((batch,), 6.0).to(dtype))
    return out


#: FramePack's frame-index keywords of the parts in sequence order (4x history, 2x history,
#: clean, latent).
FRAMEPACK_INDICES = ("indices_latents_history_4x", "indices_latents_history_2x",
                     "indices_latents_clean", "indices_latents")


def framepack_inputs(*, batch=2, frames=3, height=6, width=8, clean=2, h2=3, h4=5, txt=7,
                     image=5, seed=3, dtype=torch.float32) -> dict:
    """diffusers' FramePack forward keywords (HunyuanVideoFramepackPipeline's call) for a
    ``frames x height x width`` latent (patch 2) behind ``clean`` / ``h2`` / ``h4`` history
    frames, with padded text in the last batch item; frame indices as the inverted
    anti-drifting sampling lays them out (qkrope's ``framepack_sample_indices``: the clean part
    is the first frame and the newest history frame, not contiguous)."""
    from qkrope.families.hunyuan_video.dropin import framepack_sample_indices

    _, cfg = VARIANTS["hunyuan-video-framepack"]
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    channels = cfg["in_channels"]
    mask = torch.ones(batch, txt)
    mask[-1, txt // 2:] = 0
    out = dict(
        hidden_states=rand(batch, channels, frames, height, width),
        timestep=torch.linspace(900.0, 100.0, batch).to(dtype),
        encoder_hidden_states=rand(batch, txt, cfg["text_embed_dim"]),
        encoder_attention_mask=mask, pooled_projections=rand(batch, cfg["pooled_projection_dim"]),
        image_embeds=rand(batch, image, cfg["image_proj_dim"]),
        guidance=torch.full((batch,), 6.0).to(dtype),
        latents_clean=rand(batch, channels, clean, height, width),
        latents_history_2x=rand(batch, channels, h2, height, width),
        latents_history_4x=rand(batch, channels, h4, height, width))
    out.update(zip(FRAMEPACK_INDICES, framepack_sample_indices(frames, (clean, h2, h4))))
    return out
