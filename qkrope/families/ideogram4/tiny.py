"""The tiny random Ideogram 4 transformer and pipeline (tiny hook), built in code, nothing
downloaded.

The transformer: 2 blocks, 2 heads x 256 (diffusers' head width and MRoPE: 128 NeoX pairs,
sections (24, 20, 20), theta 5e6; the sidecar records the cache as one axis per pair, so the
head width is the real one), MLP 64, AdaLN 32, 16 latent channels (4 VAE channels x 2 x 2),
text features 24 (the tests' tiny transformer; the pipeline's: 13 x 12 = 156).

The pipeline: Ideogram4Pipeline with two such transformers (``transformer`` seed ``seed``,
``unconditional_transformer`` seed ``seed + 1``), a one-level AutoencoderKLFlux2 of 4 latent
channels (scale factor 1: sides are multiples of 2 pixels), the scheduler, the byte-level
tokenizer with a ChatML template and Qwen-VL's vision tokens, and a random Qwen3VLModel whose
text model has the 36 layers the pipeline taps (0, 3, ..., 33 and 35), 12 wide (2 heads x 6,
MRoPE sections 1 + 1 + 1), with a one-layer vision tower. Pass a small
``max_sequence_length`` (the pipeline pads every prompt to it; its default is 2048)."""

from __future__ import annotations

from pathlib import Path

from qkrope._deps import require
from qkrope.apps.tiny_parts import saved
from qkrope.apps.tiny_pipeline import BYTE_SPECIALS, CHATML_TEMPLATE, byte_tokenizer, randomised
from qkrope.families._contract import TinyHooks as CONTRACT  # noqa: F401

WHAT = "the tiny Ideogram 4 pipeline"

CONFIG = dict(in_channels=16, num_layers=2, attention_head_dim=256, num_attention_heads=2,
              intermediate_size=64, adaln_dim=32, llm_features_dim=24, rope_theta=5_000_000,
              mrope_section=(24, 20, 20), norm_eps=1e-5)

#: The text encoder's width, its layer count (the pipeline taps layer 35) and how many of its
#: layers' hidden states the pipeline joins into the transformer's text features.
TEXT_WIDTH, TEXT_LAYERS, TAPPED = 12, 36, 13
#: Qwen-VL's vision tokens (the encoder's config names their ids in the tokenizer)
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def build_transformer(record, seed: int = 0, **overrides):
    """The tiny random Ideogram4Transformer2DModel (random weights at a non-trivial scale: N(0,
    0.05^2) matrices, which keep the 512-wide activations finite in fp16; norm weights near
    1)."""
    diffusers = require("diffusers", WHAT)
    return randomised(diffusers.Ideogram4Transformer2DModel(**{**CONFIG, **overrides}),
                      seed, scale=0.05).eval()


def text_encoder(tokenizer, seed: int = 0):
    """A random Qwen3VLModel over ``tokenizer`` (module docstring)."""
    import torch

    require("transformers", WHAT)
    from transformers import Qwen3VLConfig, Qwen3VLModel

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    config = Qwen3VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=TEXT_WIDTH, intermediate_size=16,
                         num_hidden_layers=TEXT_LAYERS, num_attention_heads=2,
                         num_key_value_heads=2, head_dim=TEXT_WIDTH // 2,
                         max_position_embeddings=4096, pad_token_id=tokenizer.pad_token_id,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [1, 1, 1]}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                           out_hidden_size=TEXT_WIDTH, num_position_embeddings=64,
                           deepstack_visual_indexes=[0]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(seed)
    return Qwen3VLModel(config).eval()


def vae():
    """A one-level AutoencoderKLFlux2 of 4 latent channels (its batch-norm statistics over the
    16 packed channels)."""
    import torch

    diffusers = require("diffusers", WHAT)
    torch.manual_seed(0)  # diffusers initialises from the global generator
    return diffusers.AutoencoderKLFlux2(
        down_block_types=("DownEncoderBlock2D",), up_block_types=("UpDecoderBlock2D",),
        block_out_channels=(4,), layers_per_block=1, latent_channels=4, norm_num_groups=1,
        use_quant_conv=False, use_post_quant_conv=False).eval()


def build_pipeline(record, seed: int = 0):
    """The tiny Ideogram4Pipeline (in memory)."""
    diffusers = require("diffusers", WHAT)
    tokenizer = byte_tokenizer(BYTE_SPECIALS + VISION_TOKENS, chat_template=CHATML_TEMPLATE)
    features = TAPPED * TEXT_WIDTH
    return diffusers.Ideogram4Pipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae(),
        text_encoder=text_encoder(tokenizer, seed), tokenizer=tokenizer,
        transformer=build_transformer(record, seed, llm_features_dim=features),
        unconditional_transformer=build_transformer(record, seed + 1,
                                                    llm_features_dim=features))


def save_pipeline(record, directory: str | Path, seed: int = 0) -> Path:
    """The tiny Ideogram4Pipeline saved with ``save_pretrained``."""
    return saved(build_pipeline(record, seed), directory)
