"""Wan's part of the pipeline drop-in (runtime layer): ``WanPipeline``,
``WanImageToVideoPipeline`` and ``WanVideoToVideoPipeline`` call ``pipe.transformer(
hidden_states=latent [B, C, F, H, W], timestep, encoder_hidden_states,
encoder_hidden_states_image=..., attention_kwargs=..., return_dict=False)``; Wan 2.2's two
experts are two exports, ``pipe.transformer`` and ``pipe.transformer_2``, and the pipeline's
boundary switch (``boundary_ratio``) picks one per step as it does for the PyTorch models.
Image-to-video: Wan 2.2 I2V-A14B takes the image as latent channels; Wan 2.1 I2V / FLF2V also
takes the CLIP image tokens ``encoder_hidden_states_image`` ([batch, tokens, image_dim]; FLF2V's
first and last frame as [2 * batch, tokens, image_dim], given to the graph as [batch, 2 *
tokens, image_dim], diffusers' view), an input of its export.

:class:`WanTransformer` packs the latent's patches as tokens (the graph's input), builds the
image cache of its (frames, height, width) patch grid with the "grid" scheme (float64 tables,
uncentred), runs the export and unpacks the prediction to diffusers' 5-D latent. Any grid,
frame count, batch and CFG setting the export's profile admits works (nothing is traced in).

Refused in one line, never ignored: ``encoder_hidden_states_image`` to an export without the
image branch, or missing from one with it (the graph needs it), or with the attention's image
branch and a text of other than 512 tokens (diffusers' attention splits the image tokens off at
512 text tokens, hardcoded: the pipelines pad the prompt to 512), a CLIP input of the wrong
rank, batch or width, per-token timesteps that differ within a sample (TI2V-5B's
image-to-video with ``expand_timesteps``; equal ones, TI2V's text-to-video, are taken as one
per sample), a LoRA scale other than 1 or any other ``attention_kwargs``, a latent that is not
a whole number of patches.

WanVACEPipeline also passes the control latent and its per-block scales
(``control_hidden_states``, ``control_hidden_states_scale``): :class:`WanVACETransformer`.
"""

from __future__ import annotations

from qkrope.families._contract import DropinHooks as CONTRACT  # noqa: F401
import functools
import numbers

import torch

from qkrope.errors import InputError
from qkrope.runtime._dropin import (Call, Transformer, require_arguments, refuse_kwargs, short_repr,
                                    tensor_arg)
from qkrope.runtime.latents import VIDEO_5D, Latent

from . import I2V_TEXT_TOKENS, derivative


def pack(latent: torch.Tensor, patch) -> torch.Tensor:
    """[B, C, F, H, W] -> [B, f * h * w, C * pt * ph * pw]: each token one patch in (channel,
    t, h, w) order (the Conv3d weight's), tokens in (frame, row, column) order."""
    b, c, f, h, w = latent.shape
    pt, ph, pw = patch
    x = latent.reshape(b, c, f // pt, pt, h // ph, ph, w // pw, pw)
    return x.permute(0, 2, 4, 6, 1, 3, 5, 7).reshape(b, -1, c * pt * ph * pw)


def unpack(sample: torch.Tensor, grid, patch) -> torch.Tensor:
    """The graph's [B, N, pt * ph * pw * C] prediction as diffusers' [B, C, F, H, W]
    (``WanTransformer3DModel.forward``'s unpatchify)."""
    f, h, w = grid
    pt, ph, pw = patch
    b = sample.shape[0]
    x = sample.reshape(b, f, h, w, pt, ph, pw, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
    return x.flatten(6, 7).flatten(4, 5).flatten(2, 3)


def sample_request(record, img_shapes, txt_len: int) -> dict:
    """The position request of a sample of these sizes (``make_inputs``, the exporter's
    sample): the grid and the text length (its rows are identity: the text is not rotated);
    ChronoEdit's per-token positions at its default temporal skip
    (:func:`qkrope.families.wan.reference.position_request`)."""
    from .reference import position_request

    return position_request(record, {}, img_shapes, txt_len)


def _timestep(value, batch: int, what: str = "tokens") -> torch.Tensor:
    """diffusers' timestep as the graph's float32 [batch]: a number, [1] or [batch]; [batch,
    tokens] (or SkyReels-V2 diffusion forcing's [batch, frames]: ``what``) when every token
    (frame) of a sample has the same value (TI2V's expand_timesteps for text-to-video,
    diffusion forcing's synchronous steps)."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        value = torch.tensor(float(value))
    if not isinstance(value, torch.Tensor):
        raise InputError(f"timestep must be a tensor (one value per batch item); got "
                         f"{type(value).__name__} {short_repr(value, 60)}")
    if value.dim() == 2:
        if value.shape[0] != batch or not bool((value == value[:, :1]).all()):
            where = ("SkyReels-V2's asynchronous diffusion forcing or a prefix video"
                     if what == "frames" else "Wan 2.2 TI2V-5B's image-to-video, "
                     "expand_timesteps")
            raise InputError(
                f"timestep {list(value.shape)} gives different timesteps to the {what} of a "
                f"sample ({where}); the export takes one timestep per sample. Fix: run that "
                f"mode in PyTorch")
        value = value[:, 0]
    if value.dim() == 0 or (value.dim() == 1 and value.shape[0] == 1 and batch > 1):
        value = value.reshape(1).expand(batch)
    if value.dim() != 1 or value.shape[0] != batch:
        raise InputError(f"timestep must be [batch] ({batch}); got shape {list(value.shape)}")
    return value.to(torch.float32).contiguous()


class WanTransformer(Transformer):
    """What diffusers' Wan pipelines call on ``pipe.transformer`` / ``pipe.transformer_2``
    (module docstring). Built by :func:`qkrope.runtime.load_transformer` for a Wan export."""

    FORWARD_ARGS = ("hidden_states", "timestep", "encoder_hidden_states",
                    "encoder_hidden_states_image", "return_dict", "attention_kwargs")
    PIPELINES = ("WanPipeline, WanImageToVideoPipeline (Wan 2.1 I2V / FLF2V, Wan 2.2), "
                 "WanVideoToVideoPipeline; Wan 2.2's transformer and transformer_2")

    def _video(self) -> Latent:
        return Latent(VIDEO_5D, tuple(int(p) for p in self.config["patch_size"]))

    def prepare(self, hidden_states=None, timestep=None, encoder_hidden_states=None,
                encoder_hidden_states_image=None, return_dict: bool = True,
                attention_kwargs=None, **extras) -> Call:
        refuse_kwargs(attention_kwargs, "attention_kwargs")
        require_arguments("Wan", hidden_states=hidden_states, timestep=timestep,
                          encoder_hidden_states=encoder_hidden_states)
        channels = self.config.get("in_channels")
        tensor_arg(hidden_states, "hidden_states", 5, f"[batch, {channels}, frames, height, "
                   f"width] (the video latent)")
        tensor_arg(encoder_hidden_states, "encoder_hidden_states", 3,
                   f"[batch, text_tokens, {self.config.get('text_dim')}]")
        video = self._video()
        grid = video.grid(tuple(hidden_states.shape))
        batch = int(hidden_states.shape[0])
        conditioning = self._image(encoder_hidden_states_image, batch,
                                   int(encoder_hidden_states.shape[1]))
        packed = pack(hidden_states.to(self.dtype), video.patch)
        frames = bool(extras.get("enable_diffusion_forcing"))
        from .reference import position_request

        request = position_request(self.record, self.config, [grid],
                                   int(encoder_hidden_states.shape[1]))
        return Call(packed, encoder_hidden_states.to(self.dtype), request,
                    timestep=_timestep(timestep, batch, "frames" if frames else "tokens"),
                    conditioning=conditioning,
                    return_dict=return_dict,
                    unpack=functools.partial(unpack, grid=grid, patch=video.patch))

    def _image(self, image, batch: int, text_tokens: int) -> dict:
        """The graph's ``encoder_hidden_states_image`` of diffusers' argument (module
        docstring), checked: rank, batch (FLF2V's two images per item), width, text length."""
        image_dim = self.config.get("image_dim")
        if image_dim is None:
            if image is not None:
                raise InputError("encoder_hidden_states_image: this export has no image "
                                 "branch (its model's config has no image_dim; diffusers' "
                                 "forward fails on it too). Fix: drop it, or export a Wan 2.1 "
                                 "I2V / FLF2V model")
            return {}
        pair = self.config.get("pos_embed_seq_len") is not None
        if image is None:
            raise InputError("the Wan 2.1 I2V export needs encoder_hidden_states_image (the "
                             "CLIP image tokens; WanImageToVideoPipeline passes them); got None")
        tensor_arg(image, "encoder_hidden_states_image", 3,
                   f"[{'2 * ' if pair else ''}batch, image_tokens, {image_dim}] (the CLIP "
                   f"image embeddings)")
        want = 2 * batch if pair else batch
        if int(image.shape[0]) != want or int(image.shape[2]) != int(image_dim):
            raise InputError(f"encoder_hidden_states_image {list(image.shape)} must be [{want}, "
                             f"image_tokens, {image_dim}] for a latent batch of {batch}"
                             f"{' (FLF2V: the first and last frame of each item)' if pair else ''}")
        if self.config.get("added_kv_proj_dim") is not None and text_tokens != I2V_TEXT_TOKENS:
            raise InputError(f"encoder_hidden_states {text_tokens} text tokens with "
                             f"encoder_hidden_states_image: diffusers' Wan 2.1 I2V attention "
                             f"takes the last {I2V_TEXT_TOKENS} tokens as the text (hardcoded), "
                             f"so only {I2V_TEXT_TOKENS} computes the image branch. Fix: pad "
                             f"the prompt embeddings to {I2V_TEXT_TOKENS} tokens, as the "
                             f"pipeline does (max_sequence_length {I2V_TEXT_TOKENS})")
        if pair:  # diffusers' view: each item's two images side by side
            image = image.reshape(batch, 2 * int(image.shape[1]), int(image.shape[2]))
        return {"encoder_hidden_states_image": image.to(self.dtype)}


class SkyReelsV2Transformer(WanTransformer):
    """SkyReels-V2's drop-in: Wan's, with the diffusion-forcing pipelines' arguments:
    ``enable_diffusion_forcing`` (a [batch, frames] timestep, taken when every frame of a
    sample has the same one: the synchronous schedule without a prefix) and ``fps`` (read only
    by an ``inject_sample_info`` model, which the export refuses; ignored, as diffusers ignores
    it), and ``_set_ar_attention`` (a causal block of 1 frame: the export's full attention)."""

    FORWARD_ARGS = WanTransformer.FORWARD_ARGS[:-2] + ("enable_diffusion_forcing", "fps",
                                                       "return_dict", "attention_kwargs")
    PIPELINES = ("SkyReelsV2Pipeline, SkyReelsV2ImageToVideoPipeline, SkyReelsV2Diffusion"
                 "ForcingPipeline (synchronous, causal_block_size 1) and its I2V / V2V")

    def _set_ar_attention(self, causal_block_size):
        if causal_block_size != 1:
            raise InputError(f"causal_block_size {causal_block_size!r}: the SkyReels-V2 export "
                             f"attends over every frame (num_frame_per_block 1); a block-"
                             f"causal mask is not in the graph. Fix: causal_block_size 1 (or "
                             f"None), or run asynchronous diffusion forcing in PyTorch")


class WanVACETransformer(WanTransformer):
    """Wan-VACE's drop-in: Wan's call with WanVACEPipeline's control latent
    ``control_hidden_states`` [batch, vace_in_channels, frames, height, width] (the latent's
    size: the pipeline's is) and ``control_hidden_states_scale`` (one scale per control block;
    None: ones, as diffusers), packed as the latent and passed to the export as float32 scales.
    Refused in one line: a control latent missing, of another rank, batch, channel count or
    grid than the latent (diffusers pads a shorter one's embedded tokens with zeros, which the
    export does not), scales of another count."""

    FORWARD_ARGS = WanTransformer.FORWARD_ARGS[:-2] + ("control_hidden_states",
                                                       "control_hidden_states_scale",
                                                       "return_dict", "attention_kwargs")
    PIPELINES = "WanVACEPipeline (Wan 2.1 VACE; a Wan 2.2 transformer_2 as a second export)"

    def prepare(self, hidden_states=None, timestep=None, encoder_hidden_states=None,
                encoder_hidden_states_image=None, control_hidden_states=None,
                control_hidden_states_scale=None, return_dict: bool = True,
                attention_kwargs=None) -> Call:
        call = super().prepare(hidden_states, timestep, encoder_hidden_states,
                               encoder_hidden_states_image, return_dict, attention_kwargs)
        call.conditioning.update(self._control(hidden_states, control_hidden_states,
                                               control_hidden_states_scale))
        return call

    def _control(self, latent, control, scale) -> dict:
        from . import control_layers

        channels = int(self.config["vace_in_channels"])
        count = len(control_layers(self.config))
        if control is None:
            raise InputError("the Wan-VACE export needs control_hidden_states (the control "
                             "latent WanVACEPipeline passes); got None")
        tensor_arg(control, "control_hidden_states", 5,
                   f"[batch, {channels}, frames, height, width] (the control latent)")
        want = (int(latent.shape[0]), channels) + tuple(int(d) for d in latent.shape[2:])
        if tuple(int(d) for d in control.shape) != want:
            raise InputError(f"control_hidden_states {list(control.shape)} must be {list(want)}"
                             f" (the latent's batch, frames, height and width, {channels} "
                             f"channels): the export takes a control latent of the latent's "
                             f"size, as WanVACEPipeline makes it. Fix: pass one of that size, "
                             f"or run this call in PyTorch")
        if scale is None:
            scale = torch.ones(count)
        elif isinstance(scale, numbers.Real) and not isinstance(scale, bool):
            scale = torch.full((count,), float(scale))
        if not isinstance(scale, torch.Tensor) or scale.dim() != 1 or                 int(scale.shape[0]) != count:
            raise InputError(f"control_hidden_states_scale must be [{count}] (one scale per "
                             f"control block, vace_layers); got {short_repr(scale, 60)}")
        return {"control_hidden_states": pack(control.to(self.dtype), self._video().patch),
                "control_hidden_states_scale": scale.to(device=latent.device,
                                                        dtype=torch.float32)}


def dropin_class(record):
    """The drop-in class of ``record`` (the registry's entry point)."""
    facts = derivative(record)
    if facts.control_layers_key is not None:
        return WanVACETransformer
    return SkyReelsV2Transformer if facts.forward_extras else WanTransformer


__all__ = ["SkyReelsV2Transformer", "WanTransformer", "WanVACETransformer", "dropin_class",
           "sample_request"]
