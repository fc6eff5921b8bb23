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
