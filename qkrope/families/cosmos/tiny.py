"""The tiny random Cosmos-Predict2 pipeline (tiny hook: :func:`save_pipeline`), built in code:
diffusers' Cosmos-Predict2 test transformer (tests/pipelines/cosmos/test_cosmos2_video2world.py:
2 blocks x 2 heads x 16; the tests' tiny Cosmos, read from here by tests/_families.py) in its
Text2Image form (16 input channels, no condition mask), diffusers' tiny AutoencoderKLWan of 16
channels, and Cosmos2TextToImagePipeline's T5 encoder as a random 1-layer T5EncoderModel of
width 32 with a byte-level tokenizer.

Not runnable from a prompt without cosmos_guardrail: diffusers' Cosmos2 pipelines build their
CosmosSafetyChecker when a folder has none (it needs the cosmos_guardrail package and its
downloaded guardrail models), so the folder is saved with no safety checker and loading it
asks for cosmos_guardrail."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from qkrope._deps import require
from qkrope.apps.tiny_pipeline import byte_tokenizer, randomised, t5_encoder

#: diffusers' Cosmos-Predict2 Video2World test config (a condition-mask channel)
COSMOS_CONFIG = dict(in_channels=16 + 1, out_channels=16, num_attention_heads=2,
                     attention_head_dim=16, num_layers=2, mlp_ratio=2, text_embed_dim=32,
                     adaln_lora_dim=4, max_size=(4, 32, 32), patch_size=(1, 2, 2),
                     rope_scale=(2.0, 1.0, 1.0), concat_padding_mask=True,
                     extra_pos_embed_type="learnable")


def cosmos_transformer(seed: int = 0, **overrides):
    """The tiny Cosmos-Predict2 transformer, weights ~ N(0, 0.2^2) (diffusers zeroes the
    learnable positional embedding)."""
    diffusers = require("diffusers", "the tiny Cosmos-Predict2 pipeline")
    torch.manual_seed(seed)
    model = diffusers.CosmosTransformer3DModel(**{**COSMOS_CONFIG, **overrides})
    return randomised(model, seed, scale=0.2, vector_scale=None, norms_near_one=False)


def vae():
    """diffusers' tiny Wan VAE of the Cosmos2 pipeline tests (16 latent channels)."""
    diffusers = require("diffusers", "the tiny Cosmos-Predict2 pipeline")
    torch.manual_seed(0)
    return diffusers.AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1],
                                      num_res_blocks=1,
                                      temperal_downsample=[False, True, True]).eval()


def save_pipeline(record, directory: str | Path, seed: int = 0) -> Path:
    """The tiny Cosmos2TextToImagePipeline's folder: each component saved with
    ``save_pretrained`` and model_index.json written as the pipeline's own save writes it
    (the pipeline object cannot be made without a safety checker, see above)."""
    diffusers = require("diffusers", "the tiny Cosmos-Predict2 pipeline")
    require("transformers", "the tiny Cosmos-Predict2 pipeline's text encoder")
    tok = byte_tokenizer(model_max_length=512, append_eos=True)
    components = dict(
        text_encoder=t5_encoder(tok, COSMOS_CONFIG["text_embed_dim"], seed), tokenizer=tok,
        transformer=cosmos_transformer(seed, in_channels=16), vae=vae(),
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(use_karras_sigmas=True))
    directory = Path(directory)
    directory.mkdir(parents=True)
    index = {"_class_name": "Cosmos2TextToImagePipeline",
             "_diffusers_version": diffusers.__version__, "safety_checker": [None, None]}
    for name, component in components.items():
        component.save_pretrained(str(directory / name))
        library = "diffusers" if type(component).__module__.startswith("diffusers") \
            else "transformers"
        index[name] = [library, type(component).__name__]
    (directory / "model_index.json").write_text(json.dumps(index, indent=2, sort_keys=True))
    return directory
