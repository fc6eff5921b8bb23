"""HunyuanVideo-1.5's, HunyuanVideo's and HunyuanVideo FramePack's reference hook (runtime
layer): the keyword arguments of diffusers' ``HunyuanVideo15Transformer3DModel`` /
``HunyuanVideoTransformer3DModel`` / ``HunyuanVideoFramepackTransformer3DModel.forward`` for
``qkrope check``: the graph inputs by role, and no caches (diffusers builds its RoPE from the
latent's own shape; FramePack's from the frame indices of each part, which are the sample
request's layout: the drop-in's ``framepack_sample_indices`` of the latent's and the history
latents' frames)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

#: The images a sample takes: the one video grid the latent is (its "grid" scheme takes more:
#: Qwen-Image's condition images), so a check's default sample has one.
IMAGES = 1

#: diffusers' keyword of each graph input role (the text mask's role is the generic one).
_KEYWORDS = {"hidden_states": "hidden_states", "timestep": "timestep",
             "encoder_hidden_states": "encoder_hidden_states",
             "encoder_hidden_states_mask": "encoder_attention_mask",
             "encoder_hidden_states_2": "encoder_hidden_states_2",
             "encoder_attention_mask_2": "encoder_attention_mask_2",
             "image_embeds": "image_embeds", "pooled_projections": "pooled_projections",
             "guidance": "guidance", "latents_clean": "latents_clean",
             "latents_history_2x": "latents_history_2x",
             "latents_history_4x": "latents_history_4x"}
#: FramePack's history roles in the order of its sample's frame counts (clean, 2x, 4x), and
#: diffusers' index keywords of the parts in sequence order (4x, 2x, clean, latent).
_HISTORY = ("latents_clean", "latents_history_2x", "latents_history_4x")
_INDICES = ("indices_latents_history_4x", "indices_latents_history_2x", "indices_latents_clean",
            "indices_latents")


def forward_kwargs(info, by_role: Mapping[str, Any],
                   img_shapes: Sequence[Sequence[int]]) -> dict:
    """diffusers' forward arguments for the graph inputs ``by_role`` (``img_shapes`` is not
    needed: the latent's shape is its grid; FramePack's frame indices are those the sample
    request laid out for the latent's and the history latents' frames)."""
    kw = {_KEYWORDS[role]: value for role, value in by_role.items() if role in _KEYWORDS}
    if all(role in by_role for role in _HISTORY):  # FramePack: the sample's frame indices
        from .dropin import framepack_sample_indices

        patch_t = int(info.config.diffusers_config.get("patch_size_t", 1))
        frames = int(by_role["hidden_states"].shape[2]) // patch_t
        history = [int(by_role[role].shape[2]) for role in _HISTORY]
        kw.update(zip(_INDICES, framepack_sample_indices(frames, history)))
    kw["return_dict"] = False
    return kw
