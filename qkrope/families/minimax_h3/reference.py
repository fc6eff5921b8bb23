"""MiniMax-H3's reference hook (runtime layer): the keyword arguments of diffusers'
``MiniMaxH3Transformer3DModel.forward`` for ``qkrope check``: the graph inputs as they are, with
``position_ids`` in place of the caches (the packed layout of the sample,
:func:`qkrope.families.minimax_h3.dropin.packed_layout`, rebuilt from the index tensors)."""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from qkrope.families._contract import ReferenceHooks as CONTRACT  # noqa: F401

#: The images a sample takes: the one video grid.
IMAGES = 1


def position_ids(by_role: Mapping[str, Any], img_shapes: Sequence[Sequence[int]]):
    """The packed rows' ``(t, h, w)`` positions of the sample the caches were built from: the
    sample request's positions scattered by the index tensors."""
    import torch

    from .dropin import sample_request

    nt = int(by_role["text_indices"].shape[0])
    na = int(by_role["audio_indices"].shape[0])
    request = sample_request(None, img_shapes, nt + na)
    rows = int(by_role["timestep_indices"].shape[0])
    pos = torch.zeros(rows, 3)
    pos[by_role["video_indices"]] = request["img_ids"]
    pos[by_role["text_indices"]] = request["txt_ids"][:nt]
    pos[by_role["audio_indices"]] = request["txt_ids"][nt:]
    return pos


def forward_kwargs(info, by_role: Mapping[str, Any],
                   img_shapes: Sequence[Sequence[int]]) -> dict:
    """diffusers' forward arguments for the graph inputs ``by_role``."""
    return dict(hidden_states=by_role["hidden_states"],
                audio_hidden_states=by_role["audio_hidden_states"],
                encoder_hidden_states=by_role["encoder_hidden_states"],
                timestep=by_role["timestep"], timestep_indices=by_role["timestep_indices"],
                token_tags=by_role["token_tags"],
                position_ids=position_ids(by_role, img_shapes),
                video_indices=by_role["video_indices"], audio_indices=by_role["audio_indices"],
                text_indices=by_role["text_indices"], return_dict=False)


def sample_inputs(info, sizes: Mapping[str, int]) -> dict:
    """The packed sequence of a check's sample (``sizes``: img_tokens video rows, txt_tokens
    text rows, audio_tokens audio rows), laid out as :func:`qkrope.families.minimax_h3.dropin
    .packed_layout` does (text, video, audio), at two noise levels: the text rows clean
    (timestep 0), the video and audio rows at 0.6."""
    import numpy as np

    from .dropin import AUDIO_TAG, TEXT_TAG, VIDEO_TAG

    nt, nv, na = (int(sizes[k]) for k in ("txt_tokens", "img_tokens", "audio_tokens"))
    rows = nt + nv + na
    tags = np.concatenate([np.full(nt, TEXT_TAG), np.full(nv, VIDEO_TAG),
                           np.full(na, AUDIO_TAG)]).astype(np.int64)
    return dict(timestep_levels=np.array([0.6, 0.0], np.float32),
                timestep_indices=(tags == TEXT_TAG).astype(np.int64), token_tags=tags,
                text_indices=np.arange(nt, dtype=np.int64),
                video_indices=np.arange(nt, nt + nv, dtype=np.int64),
                audio_indices=np.arange(nt + nv, rows, dtype=np.int64))
