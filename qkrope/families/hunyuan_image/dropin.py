"""HunyuanImage-2.1's part of the pipeline drop-in (runtime layer): ``HunyuanImagePipeline``
calls ``pipe.transformer(hidden_states=[B, C, H, W], timestep, guidance, encoder_hidden_states,
encoder_attention_mask, encoder_hidden_states_2, encoder_attention_mask_2, timestep_r,
attention_kwargs, return_dict)``, and ``HunyuanImageRefinerPipeline`` the same with a 5-D
``[B, C, 1, H, W]`` latent and no byT5 text (the same transformer class with a 3-D patch and
three RoPE axes). :class:`HunyuanImageTransformer` packs the latent into the tokens the graph
takes (:func:`qkrope.runtime.latents.pack_patches`), asks the "patch-grid" scheme for the
caches of its token grid, and unpacks the sample as diffusers' unpatchify does.

The byT5 glyph text (``encoder_hidden_states_2`` and ``encoder_attention_mask_2``: a prompt with
quoted text) goes to the graph's glyph inputs; the text cache covers the text and glyph tokens.

Refused in one line, never ignored: glyph text with any real token for an export without the
glyph inputs (exported by an older qkrope), MeanFlow's ``timestep_r``, a LoRA scale other than
1 (or other ``attention_kwargs``), no ``encoder_attention_mask``, a ``guidance`` missing for a
guidance-distilled export. Ignored as diffusers' own model ignores them: byT5 tensors whose mask
is all False to an export without the glyph inputs (masked keys change no image token),
``guidance`` for a model without guidance embeddings.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from qkrope.errors import InputError
from qkrope.runtime._dropin import (Call, Transformer, require_arguments, per_item, refuse_kwargs,
                                    tensor_arg)
from qkrope.runtime.latents import pack_patches, unpack_patches
from qkrope.runtime.schemes import patch_grid


def sample_request(record, img_shapes: Sequence[Sequence[int]], txt_len: int) -> dict:
    """The position request of a sample of these sizes (``make_inputs``, the exporter's
    sample): the first grid (the latent's) and the text length."""
    return patch_grid.sample_request(img_shapes, txt_len)


class HunyuanImageTransformer(Transformer):
    """What diffusers' HunyuanImage pipelines call on ``pipe.transformer`` (module docstring).
    Built by :func:`qkrope.runtime.load_transformer` for a HunyuanImage export."""

    FORWARD_ARGS = ("hidden_states", "timestep", "encoder_hidden_states",
                    "encoder_attention_mask", "timestep_r", "encoder_hidden_states_2",
                    "encoder_attention_mask_2", "guidance", "attention_kwargs", "return_dict")
    PIPELINES = "HunyuanImagePipeline, HunyuanImageRefinerPipeline"

    def __init__(self, runner, record, *, device=None):
        super().__init__(runner, record, device=device)
        self._guided = "guidance" in runner.io.roles
        self._patch = tuple(int(p) for p in self.config.get("patch_size", (1, 1)))

    def prepare(self, hidden_states=None, timestep=None, encoder_hidden_states=None,
                encoder_attention_mask=None, timestep_r=None, encoder_hidden_states_2=None,
                encoder_attention_mask_2=None, guidance=None, attention_kwargs=None,
                return_dict: bool = True) -> Call:
        refuse_kwargs(attention_kwargs, "attention_kwargs")
        if timestep_r is not None:
            raise InputError("timestep_r (MeanFlow) was given, but the exported HunyuanImage "
                             "graph takes one timestep. Fix: run the MeanFlow-distilled model "
                             "on PyTorch")
        glyph_inputs = "encoder_hidden_states_2" in self._runner.io.roles
        if not glyph_inputs and encoder_hidden_states_2 is not None and (
                encoder_attention_mask_2 is None or bool(torch.as_tensor(
                    encoder_attention_mask_2).bool().any())):
            raise InputError("encoder_hidden_states_2 holds byT5 glyph text (a prompt with quoted "
                             "text), which this export does not take (exported without the "
                             "glyph inputs: an older qkrope, or a model without "
                             "context_embedder_2). Fix: re-export the model with this qkrope")
        require_arguments(self.record.short, hidden_states=hidden_states, timestep=timestep,
                          encoder_hidden_states=encoder_hidden_states,
                          encoder_attention_mask=encoder_attention_mask)
        rank = 2 + len(self._patch)
        tensor_arg(hidden_states, "hidden_states", rank,
                   "[batch, channels, " + ("frames, " if rank == 5 else "") + "height, width]")
        tensor_arg(encoder_hidden_states, "encoder_hidden_states", 3,
                   f"[batch, text_tokens, {self.config.get('text_embed_dim')}]")
        tokens, grid = pack_patches(hidden_states, self._patch)
        batch, txt = int(tokens.shape[0]), int(encoder_hidden_states.shape[1])
        mask = tensor_arg(encoder_attention_mask, "encoder_attention_mask", 2,
                          f"[batch, {txt}] (1 = a real text token)")
        if tuple(mask.shape) != (batch, txt) or tuple(encoder_hidden_states.shape[:1]) != (batch,):
            raise InputError(f"encoder_hidden_states {list(encoder_hidden_states.shape)} and "
                             f"encoder_attention_mask {list(mask.shape)} must be [batch={batch}, "
                             f"text tokens] like the latent's batch. Fix: pass the pipeline's "
                             f"prompt_embeds and prompt_embeds_mask")
        conditioning = {}
        if glyph_inputs:
            conditioning.update(self._glyph(encoder_hidden_states_2, encoder_attention_mask_2,
                                            batch, tokens.device))
            txt += int(conditioning["encoder_hidden_states_2"].shape[1])
        if self._guided:
            if guidance is None:
                raise InputError("this transformer embeds a distilled guidance scale "
                                 "(guidance_embeds=True) and needs guidance=[batch] values; got "
                                 "None. Fix: pass distilled_guidance_scale to the pipeline")
            conditioning["guidance"] = per_item(guidance, "guidance", batch, self.dtype)
        # a model without guidance embeddings: diffusers ignores guidance, so does this
        grid3 = grid if len(grid) == 3 else (1,) + tuple(grid)
        # the text cache: a row per text and glyph token (identity rows: not rotated)
        return Call(tokens.to(self.dtype), encoder_hidden_states.to(self.dtype),
                    {"img_shapes": [grid3], "txt_seq_len": txt},
                    timestep=per_item(timestep, "timestep", batch, self.dtype),
                    mask=mask.to(torch.bool), conditioning=conditioning,
                    return_dict=return_dict,
                    unpack=lambda sample: unpack_patches(sample, grid, self._patch).contiguous())

    def _glyph(self, glyph, glyph_mask, batch: int, device) -> dict:
        """The graph's glyph inputs: the byT5 tokens ``[batch, txt2_tokens, text_embed_2_dim]``
        and their mask as bool ``[batch, txt2_tokens]`` (the graph's, as the text's). None (a call without glyph text) is
        one padded glyph token: diffusers joins no glyph stream then, and a masked token is
        never attended (the image differs by the order of the text keys' sums alone)."""
        width = self.config.get("text_embed_2_dim")
        if glyph is None:
            if glyph_mask is not None:
                raise InputError("encoder_attention_mask_2 was given without "
                                 "encoder_hidden_states_2. Fix: pass both (the pipeline's "
                                 "prompt_embeds_2 and prompt_embeds_mask_2) or neither")
            return {"encoder_hidden_states_2": torch.zeros(batch, 1, int(width), dtype=self.dtype,
                                                           device=device),
                    "encoder_attention_mask_2": torch.zeros(batch, 1, dtype=torch.bool,
                                                            device=device)}
        tensor_arg(glyph, "encoder_hidden_states_2", 3, f"[batch, glyph_tokens, {width}]")
        tensor_arg(glyph_mask, "encoder_attention_mask_2", 2,
                   "[batch, glyph_tokens] (1 = a real glyph token)",
                   fix="pass the pipeline's prompt_embeds_mask_2 with encoder_hidden_states_2")
        want = (batch, int(glyph.shape[1]))
        if tuple(glyph.shape[:2]) != want or tuple(glyph_mask.shape) != want \
                or int(glyph.shape[2]) != int(width):
            raise InputError(f"encoder_hidden_states_2 {list(glyph.shape)} and "
                             f"encoder_attention_mask_2 {list(glyph_mask.shape)} must be "
                             f"[batch={batch}, glyph tokens, {width}] and [batch={batch}, glyph "
                             f"tokens]. Fix: pass the pipeline's prompt_embeds_2 and "
                             f"prompt_embeds_mask_2")
        return {"encoder_hidden_states_2": glyph.to(self.dtype),
                "encoder_attention_mask_2": glyph_mask.to(torch.bool)}


def dropin_class(record):
    """The drop-in class of ``record`` (the registry's entry point)."""
    return HunyuanImageTransformer



__all__ = ["HunyuanImageTransformer", "dropin_class", "sample_request"]
