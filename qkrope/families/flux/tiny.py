"""The tiny random FLUX.1 and FLUX.2 pipelines (tiny hook: :func:`save_pipeline`), built in
code at diffusers' own test sizes (tests/models/transformers/test_models_transformer_flux*.py:
2 heads x 16, RoPE axes (4, 4, 8) / (4, 4, 4, 4)):

- FLUX.1: FluxPipeline on the schnell-shaped transformer (1 + 1 blocks, no guidance input),
  a random 1-layer CLIPTextModel (pooled width 32) and T5EncoderModel (width 32) with byte-level
  tokenizers, diffusers' pipeline-test VAE (one level, 1 latent channel);
- FLUX.2: Flux2KleinPipeline (a Qwen3 text encoder whose hidden states 9, 18 and 27 are joined:
  28 layers of width 16, so the transformer's text width is 48); FLUX.2 [dev]'s Flux2Pipeline
  from :func:`pipeline_parts` (a Mistral3 encoder of 31 text layers of width 16, hidden states
  10, 20 and 30, with a 1-layer Pixtral vision tower it never calls; the transformer with
  guidance embeddings). Its prompt goes through the byte tokenizer's chat template: the real
  folder's Pixtral processor needs torchvision, and the pipeline calls only its
  ``apply_chat_template``, which a tokenizer has with the same arguments.

The transformer configs are the FLUX tests' (tests/_flux_models.py reads them here)."""

from __future__ import annotations

from pathlib import Path

import torch

from qkrope._deps import require
from qkrope.apps.tiny_parts import one_level_vae, saved
from qkrope.families.flux import DEV_LAYERS, KLEIN_LAYERS
from qkrope.apps.tiny_pipeline import (CHATML_TEMPLATE, byte_tokenizer, clip_text_encoder,
                                       decoder_encoder, randomised, t5_encoder)

_FLUX1 = dict(patch_size=1, in_channels=4, attention_head_dim=16, num_attention_heads=2,
              joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 4, 8])
_FLUX2 = dict(patch_size=1, in_channels=4, attention_head_dim=16, num_attention_heads=2,
              joint_attention_dim=32, timestep_guidance_channels=256, axes_dims_rope=[4, 4, 4, 4])
#: variant -> (record name, diffusers class name, config): the tests' tiny transformers
VARIANTS = {
    "flux1-dev": ("flux1", "FluxTransformer2DModel",
                  dict(_FLUX1, num_layers=2, num_single_layers=2, guidance_embeds=True)),
    "flux1-schnell": ("flux1", "FluxTransformer2DModel",
                      dict(_FLUX1, num_layers=1, num_single_layers=1, guidance_embeds=False)),
    "flux2-dev": ("flux2", "Flux2Transformer2DModel",
                  dict(_FLUX2, num_layers=1, num_single_layers=1, guidance_embeds=True)),
    "flux2-klein": ("flux2", "Flux2Transformer2DModel",
                    dict(_FLUX2, num_layers=1, num_single_layers=1, guidance_embeds=False)),
}
#: the tiny Qwen3's width: Flux2KleinPipeline joins its hidden states KLEIN_LAYERS (the
#: pipeline's default, the family record's reads)
KLEIN_WIDTH = 16


def transformer(variant: str, seed: int = 0, **overrides):
    """A tiny random FLUX transformer of ``variant`` (:data:`VARIANTS`)."""
    diffusers = require("diffusers", "the tiny FLUX pipelines")
    _, cls, config = VARIANTS[variant]
    return randomised(getattr(diffusers, cls)(**{**config, **overrides}), seed)


def vae(name: str):
    """diffusers' pipeline-test VAE sizes: one level (vae_scale_factor 1), 1 latent channel, so
    that 2x2 packing gives the transformer's 4 input channels (``name``: flux1 or flux2)."""
    if name == "flux1":
        return one_level_vae("the tiny FLUX pipelines")
    diffusers = require("diffusers", "the tiny FLUX pipelines")
    torch.manual_seed(0)  # diffusers initialises from the global generator
    return diffusers.AutoencoderKLFlux2(
        down_block_types=("DownEncoderBlock2D",), up_block_types=("UpDecoderBlock2D",),
        block_out_channels=(4,), layers_per_block=1, latent_channels=1, norm_num_groups=1,
        use_quant_conv=False, use_post_quant_conv=False).eval()


def save_pipeline(record, directory: str | Path, seed: int = 0) -> Path:
    """The tiny FluxPipeline (FLUX.1) or Flux2KleinPipeline (FLUX.2) saved with
    ``save_pretrained``."""
    diffusers = require("diffusers", "the tiny FLUX pipelines")
    require("transformers", "the tiny FLUX pipelines' text encoders")
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler()
    if record.name == "flux1":
        clip_tok = byte_tokenizer(model_max_length=77, append_eos=True)
        t5_tok = byte_tokenizer(model_max_length=512, append_eos=True)
        pipe = diffusers.FluxPipeline(
            scheduler=scheduler, vae=vae("flux1"),
            text_encoder=clip_text_encoder(clip_tok, _FLUX1["pooled_projection_dim"], seed),
            tokenizer=clip_tok,
            text_encoder_2=t5_encoder(t5_tok, _FLUX1["joint_attention_dim"], seed),
            tokenizer_2=t5_tok, transformer=transformer("flux1-schnell", seed))
    else:
        from transformers import Qwen3Config, Qwen3ForCausalLM

        tok = byte_tokenizer(chat_template=CHATML_TEMPLATE)
        encoder = decoder_encoder(Qwen3Config, Qwen3ForCausalLM, tok, KLEIN_WIDTH,
                                  layers=max(KLEIN_LAYERS), seed=seed, head_dim=8)
        pipe = diffusers.Flux2KleinPipeline(
            scheduler=scheduler, vae=vae("flux2"), text_encoder=encoder, tokenizer=tok,
            transformer=transformer("flux2-klein", seed,
                                    joint_attention_dim=len(KLEIN_LAYERS) * KLEIN_WIDTH))
    return saved(pipe, directory)


def mistral3_encoder(tokenizer, width: int, layers: int, seed: int = 0):
    """A random Mistral3ForConditionalGeneration over ``tokenizer``'s vocabulary: ``layers``
    text layers of ``width`` (2 query heads, 1 key/value head of 8) and a 1-layer Pixtral
    vision tower."""
    import transformers

    text = transformers.MistralConfig(
        vocab_size=len(tokenizer), hidden_size=width, intermediate_size=32,
        num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
        max_position_embeddings=4096, pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id)
    vision = transformers.PixtralVisionConfig(hidden_size=16, intermediate_size=32,
                                              num_hidden_layers=1, num_attention_heads=2,
                                              image_size=32, patch_size=16)
    torch.manual_seed(seed)
    return transformers.Mistral3ForConditionalGeneration(transformers.Mistral3Config(
        text_config=text, vision_config=vision,
        image_token_index=tokenizer.convert_tokens_to_ids(MISTRAL_IMAGE_TOKEN))).eval()


#: the image token a Mistral3 config names (its tokenizer's: the tiny byte tokenizer adds it)
MISTRAL_IMAGE_TOKEN = "[IMG]"


def pipeline_parts(record, pipeline: str, seed: int = 0) -> dict:
    """The components of ``pipeline`` (a class the record's stages serve) that differ from the
    saved tiny pipeline's: FLUX.2 [dev]'s Flux2Pipeline (module docstring)."""
    from qkrope.apps.tiny_pipeline import BYTE_SPECIALS

    if (record.name, pipeline) != ("flux2", "Flux2Pipeline"):
        return {}
    tok = byte_tokenizer(specials=(*BYTE_SPECIALS, MISTRAL_IMAGE_TOKEN),
                         chat_template=CHATML_TEMPLATE)
    return {"tokenizer": tok,
            "text_encoder": mistral3_encoder(tok, KLEIN_WIDTH, max(DEV_LAYERS) + 1, seed),
            "transformer": transformer("flux2-dev", seed,
                                       joint_attention_dim=len(DEV_LAYERS) * KLEIN_WIDTH)}
