"""Tiny HunyuanVideo-1.5 and HunyuanVideo transformers at diffusers' own test sizes
(tests/models/transformers/test_models_transformer_hunyuan_1_5.py and
test_models_transformer_hunyuan_video.py in diffusers), built in code, and their forward
inputs. The weights are random at a non-trivial scale (diffusers' init zeroes the modulations
and the output projection), RMSNorm weights near 1 but not all 1."""

from __future__ import annotations

import torch

#: variant -> (the diffusers class name, its config)
VARIANTS = {
    "hunyuan-video-1.5": ("HunyuanVideo15Transformer3DModel", dict(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=8,
        num_layers=2, num_refiner_layers=1, mlp_ratio=2.0, patch_size=1, patch_size_t=1,
        text_embed_dim=16, text_embed_2_dim=8, image_embed_dim=12, rope_axes_dim=(2, 2, 4),
        target_size=16, task_type="t2v")),
    "hunyuan-video": ("HunyuanVideoTransformer3DModel", dict(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10,
        num_layers=1, num_single_layers=1, num_refiner_layers=1, patch_size=1, patch_size_t=1,
        guidance_embeds=True, text_embed_dim=16, pooled_projection_dim=8,
        rope_axes_dim=(2, 4, 4), image_condition_type=None)),
}


def transformer(variant: str, seed: int = 0, **overrides):
    import diffusers

    name, config = VARIANTS[variant]
    g = torch.Generator().manual_seed(seed)
    model = getattr(diffusers, name)(**{**config, **overrides})
    with torch.no_grad():
        for pname, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.2 if p.dim() > 1 else 0.05)
                    + (1.0 if p.dim() == 1 and "norm" in pname else 0.0))
    return model.eval()


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
