"""The tiny random HunyuanVideo and HunyuanVideo-1.5 pipelines (tiny hook:
:func:`save_pipeline`), built in code at diffusers' own test sizes
(tests/models/transformers/test_models_transformer_hunyuan_video.py and
test_models_transformer_hunyuan_1_5.py; the tests' tiny models, read from here by
tests/_hunyuan_video_models.py):

- HunyuanVideo: HunyuanVideoPipeline with a random 3-layer LlamaModel of width 16 (the pipeline
  reads the hidden state 2 layers from the top) and a 1-layer CLIPTextModel of width 8 (the
  pooled projection), byte-level tokenizers, diffusers' pipeline-test AutoencoderKLHunyuanVideo;
- HunyuanVideo FramePack: HunyuanVideoFramepackPipeline, HunyuanVideo's components with
  diffusers' FramePack test transformer and a random 1-layer SiglipVisionModel of width 16 (the
  image embeddings) with its image processor at 32 x 32;
- HunyuanVideo-1.5: HunyuanVideo15Pipeline (text-to-video: the transformer takes 2 x 4 + 1
  channels) with a random 3-layer Qwen2_5_VLTextModel of width 16 and a ChatML chat template, a
  1-layer T5EncoderModel of width 8 for the glyph text with transformers' ByT5Tokenizer (it needs
  no vocabulary file), classifier-free guidance, a tiny AutoencoderKLHunyuanVideo15."""

from __future__ import annotations

from pathlib import Path

import torch

from qkrope._deps import require
from qkrope.apps.tiny_pipeline import (CHATML_TEMPLATE, byte_tokenizer, clip_text_encoder,
                                       decoder_encoder, randomised, t5_encoder)

#: variant (the record's name) -> (the diffusers class name, its config)
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
    # diffusers' FramePack test config (test_models_transformer_hunyuan_video_framepack.py):
    # HunyuanVideo's with patch 2, the image projection and the history patch embedder
    "hunyuan-video-framepack": ("HunyuanVideoFramepackTransformer3DModel", dict(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=10,
        num_layers=1, num_single_layers=1, num_refiner_layers=1, patch_size=2, patch_size_t=1,
        guidance_embeds=True, text_embed_dim=16, pooled_projection_dim=8,
        rope_axes_dim=(2, 4, 4), image_condition_type=None, has_image_proj=True,
        image_proj_dim=16, has_clean_x_embedder=True)),
}

#: the Qwen2.5-VL text encoder's multimodal RoPE at head width 8 (4 frequencies: its sections
#: must sum to 4; the default's [16, 24, 24] is the real model's 128)
MROPE = {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [2, 1, 1]}

def transformer(variant: str, seed: int = 0, **overrides):
    """A tiny random transformer of ``variant`` (:data:`VARIANTS`)."""
    diffusers = require("diffusers", "the tiny HunyuanVideo pipelines")
    name, config = VARIANTS[variant]
    return randomised(getattr(diffusers, name)(**{**config, **overrides}), seed)


def save_pipeline(record, directory: str | Path, seed: int = 0) -> Path:
    """The tiny HunyuanVideoPipeline, HunyuanVideoFramepackPipeline or HunyuanVideo15Pipeline
    saved with ``save_pretrained``."""
    diffusers = require("diffusers", "the tiny HunyuanVideo pipelines")
    require("transformers", "the tiny HunyuanVideo pipelines' text encoders")
    config = VARIANTS[record.name][1]
    torch.manual_seed(0)  # the VAEs initialise from the global generator
    if record.name in ("hunyuan-video", "hunyuan-video-framepack"):
        from transformers import LlamaConfig, LlamaModel

        tok = byte_tokenizer(bos="<|begin_of_text|>")
        clip_tok = byte_tokenizer(model_max_length=77, append_eos=True)
        vae = diffusers.AutoencoderKLHunyuanVideo(latent_channels=4, block_out_channels=(8,) * 4,
                                                  layers_per_block=1, norm_num_groups=4)
        parts = dict(
            text_encoder=decoder_encoder(LlamaConfig, LlamaModel, tok, config["text_embed_dim"],
                                         layers=3, seed=seed),
            tokenizer=tok, transformer=transformer(record.name, seed), vae=vae.eval(),
            scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=7.0),
            text_encoder_2=clip_text_encoder(clip_tok, config["pooled_projection_dim"], seed),
            tokenizer_2=clip_tok)
        if record.name == "hunyuan-video":
            pipe = diffusers.HunyuanVideoPipeline(**parts)
        else:
            from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

            torch.manual_seed(seed)
            siglip = SiglipVisionModel(SiglipVisionConfig(
                hidden_size=config["image_proj_dim"], intermediate_size=32, num_hidden_layers=1,
                num_attention_heads=2, image_size=32, patch_size=16))
            pipe = diffusers.HunyuanVideoFramepackPipeline(
                **parts, image_encoder=siglip.eval(),
                feature_extractor=SiglipImageProcessor(size={"height": 32, "width": 32}))
    else:
        from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

        tok = byte_tokenizer(chat_template=CHATML_TEMPLATE)
        byt5 = ByT5Tokenizer()
        vae = diffusers.AutoencoderKLHunyuanVideo15(latent_channels=4,
                                                    block_out_channels=(8,) * 5,
                                                    layers_per_block=1)
        latent = config["out_channels"]
        pipe = diffusers.HunyuanVideo15Pipeline(
            text_encoder=decoder_encoder(Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, tok,
                                         config["text_embed_dim"], layers=3, seed=seed,
                                         rope_parameters=MROPE),
            tokenizer=tok,
            transformer=transformer(record.name, seed, in_channels=2 * latent + 1),
            vae=vae.eval(), scheduler=diffusers.FlowMatchEulerDiscreteScheduler(shift=7.0),
            text_encoder_2=t5_encoder(byt5, config["text_embed_2_dim"], seed),
            tokenizer_2=byt5, guider=diffusers.ClassifierFreeGuidance(guidance_scale=6.0))
    directory = Path(directory)
    pipe.save_pretrained(str(directory))
    return directory
