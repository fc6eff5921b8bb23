"""The tiny random pipelines of the Wan folder (tiny hook: :func:`save_pipeline`, one per
record: Wan, SkyReels-V2, Wan-VACE, ChronoEdit), built in code: diffusers' own test transformer
(tests/models/transformers/test_models_transformer_wan.py: 2 blocks x 2 heads x 12, patch
(1, 2, 2), 4 channels, text 16, RoPE tables of 32 positions; the tests' tiny Wan, read from
here by tests/_families.py) or a derivative's (:data:`CONFIGS`), a tiny AutoencoderKLWan of the
transformer's output channels (4; ChronoEdit's 16), the UMT5 encoder as a random 1-layer
UMT5EncoderModel of width 16 with a byte-level tokenizer, and for ChronoEdit Wan 2.1 I2V's CLIP
image encoder at tiny size (:data:`CLIP`). One transformer each (Wan 2.2 A14B's second expert
is not made here)."""

from __future__ import annotations

from qkrope.families._contract import TinyHooks as CONTRACT  # noqa: F401
from pathlib import Path

import torch

from qkrope._deps import require
from qkrope.apps.tiny_parts import saved
from qkrope.apps.tiny_pipeline import byte_tokenizer, t5_encoder

#: Wan: diffusers' own test config (tests/models/transformers/test_models_transformer_wan.py)
WAN_CONFIG = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                  in_channels=4, out_channels=4, text_dim=16, freq_dim=256, ffn_dim=32,
                  num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads",
                  rope_max_seq_len=32)


#: Wan 2.1 I2V's image branch at tiny size: a CLIP vision tower of width 4 (2 layers, 8 x 8
#: patches of a 32 x 32 crop), the transformer's image_dim, and the branch at its width 24
CLIP = dict(hidden_size=4, num_hidden_layers=2, num_attention_heads=2, image_size=32,
            intermediate_size=16, patch_size=8)

#: The derivatives' tiny configs: Wan's, with ChronoEdit's Wan 2.1 I2V image branch (CLIP
#: width 4, the branch at the model width 24; the latent and its condition: 36 channels in, 16
#: out, as the 14B's 16 + 20) and Wan-VACE's control branch.
CONFIGS = {
    "WanTransformer3DModel": WAN_CONFIG,
    "SkyReelsV2Transformer3DModel": WAN_CONFIG,
    "ChronoEditTransformer3DModel": dict(WAN_CONFIG, in_channels=36, out_channels=16,
                                         image_dim=CLIP["hidden_size"], added_kv_proj_dim=24),
    # Wan-VACE: 3 blocks, control hints after blocks 0 and 2; the control latent of the tiny
    # VAE's WanVACEPipeline: the video's inactive and reactive latents (2 x 4 channels) and
    # the 8 x 8 mask pixels of each latent pixel (64)
    "WanVACETransformer3DModel": dict(WAN_CONFIG, num_layers=3, vace_layers=[0, 2],
                                      vace_in_channels=72),
}


def wan_transformer(seed: int = 0, class_name: str = "WanTransformer3DModel", **overrides):
    """The tiny Wan transformer (or a derivative's, by its diffusers ``class_name``: its
    :data:`CONFIGS` entry), its RMSNorm weights random (diffusers initialises them to 1,
    which would hide the row weight's h * D + d indexing)."""
    diffusers = require("diffusers", "the tiny Wan pipeline")
    torch.manual_seed(seed)
    model = getattr(diffusers, class_name)(**{**CONFIGS[class_name], **overrides}).eval()
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".norm_" in name:
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    return model


def build_transformer(record, seed: int = 0):
    """The tiny transformer of ``record``'s class (:data:`CONFIGS`): the tests' builder of the
    derivatives (tests/_families.py derives it from here)."""
    return wan_transformer(seed, record.class_name)


def vae(latent_channels: int = WAN_CONFIG["in_channels"]):
    """A tiny AutoencoderKLWan (diffusers' pipeline tests' sizes: base width 3, 8x spatial, 4x
    temporal) with ``latent_channels`` channels, identity latent normalisation."""
    diffusers = require("diffusers", "the tiny Wan pipeline")
    torch.manual_seed(0)  # diffusers initialises from the global generator
    return diffusers.AutoencoderKLWan(
        base_dim=3, z_dim=latent_channels, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
        temperal_downsample=[False, True, True], latents_mean=[0.0] * latent_channels,
        latents_std=[1.0] * latent_channels).eval()


def save_pipeline(record, directory: str | Path, seed: int = 0) -> Path:
    """The tiny pipeline of ``record``'s class saved with ``save_pretrained``: WanPipeline;
    SkyReelsV2Pipeline (UniPC on flow sigmas, shift 8, flow prediction); WanVACEPipeline; ChronoEditPipeline (Wan 2.1
    I2V's form: the CLIP image encoder and processor of :func:`clip_parts`, a VAE of
    the transformer's 16 output channels). Each on the tiny transformer of the record's
    class, so that what is saved is the family named."""
    diffusers = require("diffusers", "the tiny Wan pipelines")
    require("transformers", "the tiny Wan pipelines' text encoder")
    tok = byte_tokenizer(model_max_length=512, append_eos=True)
    parts = dict(tokenizer=tok,
                 text_encoder=t5_encoder(tok, WAN_CONFIG["text_dim"], seed, umt5=True),
                 transformer=wan_transformer(seed, record.class_name))
    flow = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)
    if record.class_name == "SkyReelsV2Transformer3DModel":
        pipe = diffusers.SkyReelsV2Pipeline(
            vae=vae(), scheduler=diffusers.UniPCMultistepScheduler(
                flow_shift=8.0, use_flow_sigmas=True, prediction_type="flow_prediction"),
            **parts)
    elif record.class_name == "WanVACETransformer3DModel":
        pipe = diffusers.WanVACEPipeline(vae=vae(), scheduler=flow, **parts)
    elif record.class_name == "ChronoEditTransformer3DModel":
        pipe = diffusers.ChronoEditPipeline(
            vae=vae(CONFIGS[record.class_name]["out_channels"]), scheduler=flow,
            **clip_parts(seed), **parts)
    else:
        pipe = diffusers.WanPipeline(vae=vae(), scheduler=flow, **parts)
    return saved(pipe, directory)


def image_to_video_parts(seed: int = 0, *, image_encoder: bool = False) -> dict:
    """The components that make the tiny pipeline a WanImageToVideoPipeline: a transformer
    taking the condition channels (the latents, the mask's 4 and the image's: Wan 2.2 I2V's
    form), and with ``image_encoder`` Wan 2.1 I2V's CLIP image encoder and processor, the
    transformer's image branch taking its hidden states."""
    z = WAN_CONFIG["in_channels"]
    if not image_encoder:
        return {"transformer": wan_transformer(seed, in_channels=2 * z + 4, out_channels=z)}
    return {"transformer": wan_transformer(seed, in_channels=2 * z + 4, out_channels=z,
                                           image_dim=CLIP["hidden_size"],
                                           added_kv_proj_dim=2 * WAN_CONFIG["attention_head_dim"]),
            **clip_parts(seed)}


def clip_parts(seed: int = 0) -> dict:
    """Wan 2.1 I2V's image encoder and processor at tiny size (:data:`CLIP`)."""
    from transformers import CLIPImageProcessor, CLIPVisionConfig, CLIPVisionModel

    torch.manual_seed(seed)
    side = CLIP["image_size"]
    return {"image_encoder": CLIPVisionModel(CLIPVisionConfig(**CLIP)).eval(),
            "image_processor": CLIPImageProcessor(crop_size=side, size=side)}
