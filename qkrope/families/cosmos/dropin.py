"""Cosmos-Predict2's part of the pipeline drop-in (runtime layer): what ``make_inputs`` needs
(:func:`sample_request`), the forward arguments of ``Cosmos2TextToImagePipeline`` /
``Cosmos2VideoToWorldPipeline`` and their refusals.

Not finished: the generic runner (qkrope.runtime.runner) takes 3-D token streams and a text
cache, and the export of a 5-D latent needs derived dynamic dimensions (latent height = patch x
tokens) in export_transformer; until both land, a Cosmos export is refused here in one line.
"""

from __future__ import annotations

from qkrope.errors import InputError
from qkrope.runtime._dropin import Call, Transformer
from qkrope.runtime.schemes import scaled_grid


def sample_request(record, img_shapes, txt_len: int) -> dict:
    """The position request of a sample: the first grid (tokens), an image call (no fps)."""
    return scaled_grid.sample_request(img_shapes[0])


class CosmosTransformer(Transformer):
    """What diffusers' Cosmos-Predict2 pipelines call on ``pipe.transformer``."""

    FORWARD_ARGS = ("hidden_states", "timestep", "encoder_hidden_states",
                    "block_controlnet_hidden_states", "attention_mask", "fps", "condition_mask",
                    "padding_mask", "return_dict")
    PIPELINES = "Cosmos2TextToImagePipeline, Cosmos2VideoToWorldPipeline"

    def prepare(self, **call) -> Call:
        raise InputError("the Cosmos-Predict2 drop-in is not available in this qkrope yet (the "
                         "runner takes no 5-D latent). Fix: run the pipeline on the PyTorch "
                         "transformer")


def dropin_class(record):
    """The drop-in class of ``record`` (the registry's entry point)."""
    return CosmosTransformer


PUBLIC: dict = {}

__all__ = ["CosmosTransformer", "dropin_class", "sample_request"]
