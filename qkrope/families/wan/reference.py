"""Wan's reference hook (runtime layer): the keyword arguments of diffusers'
``WanTransformer3DModel.forward`` for the graph inputs (the packed patches unpacked to the 5-D
latent of the sample's grid; the model computes its RoPE from that latent, in float64; Wan 2.1
I2V / FLF2V's CLIP image tokens as the pipelines pass them)."""

from __future__ import annotations

from qkrope.families._contract import ReferenceHooks as CONTRACT  # noqa: F401
from typing import Any, Mapping, Sequence

#: The images a sample takes: the one video grid the latent is (its "grid" scheme takes more:
#: Qwen-Image's condition images), so a check's default sample has one.
IMAGES = 1


def position_request(record, config, img_shapes, txt_len: int) -> dict:
    """The position request of a latent grid ``img_shapes[0]`` (frames, height, width in
    patches) and ``txt_len`` text tokens for the record's scheme: Wan's grid itself; for a
    class with a temporal skip (ChronoEdit, the "ids" scheme) every token's (frame, row,
    column) with the frames at :func:`qkrope.families.wan.frame_positions` (the text's rows are
    identity: zeros)."""
    (f, h, w), = [tuple(int(v) for v in s) for s in img_shapes[:1]]
    if record.scheme == "grid":
        from qkrope.runtime.schemes import grid

        return grid.sample_request([(f, h, w)], txt_len)
    import numpy as np

    from . import SKIP_FRAMES, derivative, frame_positions

    key = derivative(record).skip_frames_key
    skip = config.get(key) if key and hasattr(config, "get") else None
    frames = frame_positions(f, SKIP_FRAMES if key and skip is None else skip)
    t, y, x = np.meshgrid(np.asarray(frames), np.arange(h), np.arange(w), indexing="ij")
    img = np.stack([t.ravel(), y.ravel(), x.ravel()], axis=1).astype(np.float32)
    return {"txt_ids": np.zeros((int(txt_len), 3), np.float32), "img_ids": img}


def check_sample(info) -> dict:
    """The check's default sizes for this model: Wan 2.1 I2V's 512 text tokens (with the
    attention's image branch: the only length at which diffusers' forward reads the image
    tokens as image tokens), else the check's defaults."""
    from . import I2V_TEXT_TOKENS

    cfg = info.config.diffusers_config or {}
    return {"txt_len": I2V_TEXT_TOKENS} if cfg.get("added_kv_proj_dim") is not None else {}


def forward_kwargs(info, by_role: Mapping[str, Any],
                   img_shapes: Sequence[Sequence[int]]) -> dict:
    """diffusers' forward arguments for the graph inputs ``by_role``: the latent whose patches
    ``hidden_states`` packs (one grid, ``img_shapes[0]``), the text and the timestep (and
    ``encoder_hidden_states_image``: FLF2V's [B, 2 * S, D] as the pipeline's [2 * B, S, D]; Wan-VACE's
    control latent unpacked as the latent is, its hint scales in the model's dtype, as the
    pipeline passes them). Its
    output is the 5-D latent; :func:`qkrope.families.wan.dropin.pack`'s inverse order
    (:func:`graph_output`) gives the graph's packed form."""
    cfg = info.config.diffusers_config
    patch = tuple(int(p) for p in cfg["patch_size"])
    (f, h, w), = [tuple(int(v) for v in s) for s in img_shapes[:1]]
    packed = by_role["hidden_states"]
    b, c = packed.shape[0], int(cfg["in_channels"])
    pt, ph, pw = patch
    latent = packed.reshape(b, f, h, w, c, pt, ph, pw).permute(0, 4, 1, 5, 2, 6, 3, 7)
    latent = latent.reshape(b, c, f * pt, h * ph, w * pw)
    kwargs = dict(hidden_states=latent, timestep=by_role["timestep"],
                  encoder_hidden_states=by_role["encoder_hidden_states"], return_dict=False)
    control = by_role.get("control_hidden_states")
    if control is not None:  # Wan-VACE: the control latent, the scales in the model's dtype
        v = int(cfg["vace_in_channels"])
        control = control.reshape(b, f, h, w, v, pt, ph, pw).permute(0, 4, 1, 5, 2, 6, 3, 7)
        kwargs.update(control_hidden_states=control.reshape(b, v, f * pt, h * ph, w * pw),
                      control_hidden_states_scale=by_role["control_hidden_states_scale"].to(
                          packed.dtype))
    image = by_role.get("encoder_hidden_states_image")
    if image is not None:  # Wan 2.1 I2V / FLF2V
        from qkrope.errors import InputError

        from . import I2V_TEXT_TOKENS

        text = int(kwargs["encoder_hidden_states"].shape[1])
        if cfg.get("added_kv_proj_dim") is not None and text != I2V_TEXT_TOKENS:
            raise InputError(f"a sample of {text} text tokens: diffusers' Wan 2.1 I2V attention "
                             f"reads the image tokens only with {I2V_TEXT_TOKENS} text tokens "
                             f"(hardcoded), the check's reference. Fix: --txt-len "
                             f"{I2V_TEXT_TOKENS}")
        if cfg.get("pos_embed_seq_len") is not None:  # FLF2V: the pipeline's two images
            image = image.reshape(2 * image.shape[0], image.shape[1] // 2, image.shape[2])
        kwargs["encoder_hidden_states_image"] = image
    return kwargs


def graph_output(info, sample, img_shapes=None):
    """diffusers' 5-D prediction in the graph's packed form ([B, N, pt * ph * pw * C])."""
    cfg = info.config.diffusers_config
    pt, ph, pw = (int(p) for p in cfg["patch_size"])
    b, c, frames, height, width = sample.shape
    x = sample.reshape(b, c, frames // pt, pt, height // ph, ph, width // pw, pw)
    return x.permute(0, 2, 4, 6, 3, 5, 7, 1).reshape(b, -1, pt * ph * pw * c)
