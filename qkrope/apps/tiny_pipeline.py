"""A tiny random Qwen-Image pipeline built in code (nothing downloaded), for the main job's
pipeline step and the pipeline tests: a QwenImageTransformer2DModel of 2 blocks x 2 heads x 32,
an AutoencoderKLQwenImage with 4 latent channels, a flow-matching Euler scheduler, and the text
encoder bypassed with prompt embeddings."""

from __future__ import annotations

from pathlib import Path

import torch

from qkrope._deps import require

TRANSFORMER_CONFIG = dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                          attention_head_dim=32, num_attention_heads=2, joint_attention_dim=24,
                          axes_dims_rope=(8, 12, 12))
VAE_CONFIG = dict(base_dim=24, z_dim=4, dim_mult=[1, 2, 4], num_res_blocks=1,
                  temperal_downsample=[False, True], latents_mean=[0.0] * 4, latents_std=[1.0] * 4)


def tiny_transformer(seed: int = 0):
    """Random weights of a non-trivial scale (diffusers' init zeroes some layers)."""
    diffusers = require("diffusers", "the tiny Qwen-Image pipeline")
    g = torch.Generator().manual_seed(seed)
    model = diffusers.QwenImageTransformer2DModel(**TRANSFORMER_CONFIG)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.2 if p.dim() > 1 else 0.05)
                    + (1.0 if p.dim() == 1 and "norm" in name else 0.0))
    return model.eval()


def tiny_vae(seed: int = 0):
    diffusers = require("diffusers", "the tiny Qwen-Image pipeline")
    torch.manual_seed(seed)  # diffusers initialises from the global generator
    return diffusers.AutoencoderKLQwenImage(**VAE_CONFIG).eval()


def pipeline(transformer, vae, *, edit: bool = False):
    """A QwenImagePipeline (or QwenImageEditPipeline) around ``transformer`` without a text
    encoder: call it with prompt_embeds / prompt_embeds_mask."""
    diffusers = require("diffusers", "the tiny Qwen-Image pipeline")
    require("transformers", "diffusers' Qwen-Image pipelines")
    cls = diffusers.QwenImageEditPipeline if edit else diffusers.QwenImagePipeline
    extra = {"processor": None} if edit else {}
    return cls(scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=None,
               tokenizer=None, transformer=transformer, **extra)


def prompt_embeds(batch: int, tokens: int, seed: int, *, pad: int = 0):
    """Random prompt embeddings and their 1/0 mask; the last prompt is ``pad`` tokens shorter."""
    g = torch.Generator().manual_seed(seed)
    embeds = torch.randn(batch, tokens, TRANSFORMER_CONFIG["joint_attention_dim"], generator=g)
    mask = torch.ones(batch, tokens, dtype=torch.long)
    if pad:
        mask[-1, tokens - pad:] = 0
    return embeds, mask


def save_transformer(model, directory: str | Path) -> Path:
    directory = Path(directory)
    model.save_pretrained(str(directory))
    return directory


# The exported transformer's output differs from diffusers' by the fp32 summation orders of
# ONNX Runtime's and PyTorch's kernels, <= 1e-4 x max|output| (tests/test_transformer_export.py).
# A flow-matching Euler step adds (sigma_next - sigma) x output to the latents and the sigmas
# travel at most 1 in total, so the latents carry at most that error over all steps; true CFG
# combines two predictions as neg + s (pos - neg), amplifying an error by at most (1 + 2 s) before
# diffusers rescales it to the conditional prediction's norm. The predictions are of the latents'
# magnitude (unit-variance noise at the start), hence:
TRANSFORMER_PARITY = 1e-4


def latent_bound(reference: torch.Tensor, cfg_scale: float = 1.0) -> float:
    """Largest |latents - reference| an exported transformer may cause (derivation above)."""
    return float(TRANSFORMER_PARITY * (1 + 2 * max(cfg_scale, 1.0)) * reference.abs().max())


#: the tiny text encoder of :func:`save_text_pipeline`: a 1-layer Qwen2 whose width is the tiny
#: transformer's text width (the pipeline reads its last hidden state)
TEXT_ENCODER_CONFIG = dict(hidden_size=TRANSFORMER_CONFIG["joint_attention_dim"],
                           intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                           num_key_value_heads=2, max_position_embeddings=4096)


def byte_tokenizer():
    """A byte-level BPE tokenizer without merges (one token per byte, plus the chat markers the
    Qwen-Image prompt template uses), built in code: any prompt tokenizes, nothing downloaded."""
    require("transformers", "the tiny Qwen-Image pipeline's tokenizer")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    for s in specials:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<|endoftext|>",
                                   eos_token="<|im_end|>")


def save_text_pipeline(directory: str | Path, seed: int = 0) -> Path:
    """A whole tiny QwenImagePipeline saved with ``save_pretrained`` (model_index.json, the tiny
    transformer and VAE, a random 1-layer Qwen2 text encoder and :func:`byte_tokenizer`): a
    pipeline folder that runs from a prompt (``qkrope generate``)."""
    diffusers = require("diffusers", "the tiny Qwen-Image pipeline")
    require("transformers", "the tiny Qwen-Image pipeline's text encoder")
    from transformers import Qwen2Config, Qwen2Model

    tokenizer = byte_tokenizer()
    torch.manual_seed(seed)
    encoder = Qwen2Model(Qwen2Config(vocab_size=len(tokenizer), **TEXT_ENCODER_CONFIG)).eval()
    pipe = diffusers.QwenImagePipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(), vae=tiny_vae(seed),
        text_encoder=encoder, tokenizer=tokenizer, transformer=tiny_transformer(seed))
    directory = Path(directory)
    pipe.save_pretrained(str(directory))
    return directory
