"""The tiny random JoyImage Edit transformer and pipeline folder (tiny hook), built in code.

The transformer: 2 double-stream blocks x 2 heads x 32 (RoPE axes 8 + 12 + 12, theta 256 as
the released config's), 16 latent channels (the Wan VAE's), patch (1, 2, 2), text width 24.
The pipeline folder holds the transformer, diffusers' tiny AutoencoderKLWan, the scheduler, a
random Qwen3-VL text encoder (one text layer 24 wide, as the transformer's text_dim, and a one-layer
vision tower) and the byte-level tokenizer with Qwen-VL's vision tokens, so a prompt encodes
(the prompt-only call; an edit call with a reference image passes ``prompt_embeds``).
JoyImageEditPipeline's processor is saved as None: transformers defines Qwen3VLProcessor's video
processor only with torchvision, which the project does not install, so the processor cannot be
built (its constructor checks that class) and the edit call's text-with-image prompt encoding
is not reachable here. The edit call samples its reference latent from the VAE posterior with
torch's global RNG (the pipeline's ``generator`` draws only the noise): runs compared with each
other seed it alike (``torch.manual_seed`` before each; tests/test_family_joyimage.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from qkrope._deps import require
from qkrope.apps.tiny_pipeline import BYTE_SPECIALS, byte_tokenizer, randomised
from qkrope.families._contract import TinyHooks as CONTRACT  # noqa: F401

#: The tiny JoyImage Edit config (head 32 = rope_dim_list's sum).
JOYIMAGE_CONFIG = dict(patch_size=[1, 2, 2], in_channels=16, hidden_size=64,
                       num_attention_heads=2, text_dim=24, mlp_width_ratio=2.0, num_layers=2,
                       rope_dim_list=[8, 12, 12], rope_type="rope", theta=256)


def build_transformer(record, seed: int = 0, **overrides):
    """The tiny JoyImage Edit transformer, weights ~ N(0, 0.2^2), norm weights near 1."""
    diffusers = require("diffusers", "the tiny JoyImage Edit transformer")
    torch.manual_seed(seed)
    model = diffusers.JoyImageEditTransformer3DModel(**{**JOYIMAGE_CONFIG, **overrides})
    return randomised(model, seed, scale=0.2, vector_scale=0.05)


def vae():
    """diffusers' tiny Wan VAE (16 latent channels)."""
    diffusers = require("diffusers", "the tiny JoyImage Edit pipeline")
    torch.manual_seed(0)
    return diffusers.AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1],
                                      num_res_blocks=1,
                                      temperal_downsample=[False, True, True]).eval()


#: Qwen-VL's vision tokens (the text encoder's config names their ids in the tokenizer)
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def text_encoder(tokenizer, width: int, seed: int = 0):
    """A random Qwen3VLForConditionalGeneration over ``tokenizer``: one text layer of ``width``
    (2 heads x ``width // 2``, multimodal RoPE sections summing to half a head), a one-layer
    vision tower of 16 whose merged output is ``width`` wide."""
    require("transformers", "the tiny JoyImage Edit pipeline's text encoder")
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    head = width // 2
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    config = Qwen3VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=width, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                         head_dim=head, max_position_embeddings=4096,
                         pad_token_id=tokenizer.pad_token_id,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [head // 6, head // 6,
                                                            head // 2 - 2 * (head // 6)]}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2,
                           patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                           out_hidden_size=width, num_position_embeddings=64,
                           deepstack_visual_indexes=[0]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(seed)
    return Qwen3VLForConditionalGeneration(config).eval()


def save_pipeline(record, directory: str | Path, seed: int = 0) -> Path:
    """The tiny JoyImageEditPipeline folder: every component saved with ``save_pretrained``,
    the processor None (module docstring)."""
    diffusers = require("diffusers", "the tiny JoyImage Edit pipeline")
    transformer = build_transformer(record, seed)
    tokenizer = byte_tokenizer(BYTE_SPECIALS + VISION_TOKENS)
    components = dict(transformer=transformer, vae=vae(),
                      scheduler=diffusers.FlowMatchEulerDiscreteScheduler(),
                      text_encoder=text_encoder(tokenizer, transformer.config.text_dim, seed),
                      tokenizer=tokenizer)
    directory = Path(directory)
    directory.mkdir(parents=True)
    index = {"_class_name": "JoyImageEditPipeline", "_diffusers_version": diffusers.__version__,
             "processor": [None, None]}
    for name, component in components.items():
        component.save_pretrained(str(directory / name))
        library = type(component).__module__.split(".")[0]  # diffusers or transformers
        index[name] = [library, type(component).__name__]
    (directory / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
    return directory
