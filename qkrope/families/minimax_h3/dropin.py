"""MiniMax-H3's part of the drop-in (runtime layer). diffusers 0.42.1 has no MiniMax-H3
pipeline: the drop-in takes the transformer's own call, ``pipe.transformer(hidden_states=,
audio_hidden_states=, encoder_hidden_states=, timestep=, timestep_indices=, token_tags=,
position_ids=, video_indices=, audio_indices=, text_indices=, return_dict=)``, and returns
diffusers' ``MiniMaxH3TransformerOutput(sample, audio_sample)`` (or the pair).

:class:`MiniMaxH3Transformer` asks the "ids-float32" scheme for the caches of the rows'
``position_ids`` (the video rows' as the image stream, the text rows' then the audio rows' as the
text stream: :func:`stream_request`) and passes the rest by role. Refused in one line:
``attention_kwargs`` other than a LoRA scale of 1, a packed sequence whose rows the three index
tensors do not fill exactly once (diffusers would attend a zero row the graph does not hold), and
shapes that disagree.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from qkrope.errors import InputError
from qkrope.families._contract import DropinHooks as CONTRACT  # noqa: F401
from qkrope.runtime._dropin import (Call, Transformer, refuse_kwargs, require_arguments,
                                    short_repr, tensor_arg)

#: diffusers' stream tags (0 video, 1 text, 2 audio).
VIDEO_TAG, TEXT_TAG, AUDIO_TAG = 0, 1, 2


def packed_layout(grid: Sequence[int], txt_len: int, audio_len: int) -> dict:
    """A packed sequence of ``txt_len`` text rows, a video grid ``(f, h, w)`` in patches and
    ``audio_len`` audio rows, laid out as qkrope's samples lay it out (diffusers has no pipeline
    to copy): text rows first at positions ``(i, 0, 0)``, then the video rows in (frame, row,
    column) order at ``(f, h, w)``, then the audio rows at ``(txt_len + k, 0, 0)``; the text
    and the first video frame at noise level 1 (timestep 0: clean conditioning rows), the
    other video frames and the audio at level 0. int64 index tensors, float32 positions."""
    f, h, w = (int(v) for v in grid)
    nt, nv, na = int(txt_len), f * h * w, int(audio_len)
    frame, row, col = torch.meshgrid(torch.arange(f), torch.arange(h), torch.arange(w),
                                     indexing="ij")
    video_pos = torch.stack([frame.reshape(-1), row.reshape(-1), col.reshape(-1)], dim=1)
    line = torch.zeros(nt + na, 3, dtype=torch.int64)
    line[:, 0] = torch.arange(nt + na)
    position_ids = torch.cat([line[:nt], video_pos, line[nt:]]).float()
    tags = torch.cat([torch.full((nt,), TEXT_TAG), torch.full((nv,), VIDEO_TAG),
                      torch.full((na,), AUDIO_TAG)]).to(torch.int64)
    levels = torch.cat([torch.ones(nt), (frame.reshape(-1) > 0).logical_not().float(),
                        torch.zeros(na)]).to(torch.int64)
    return dict(position_ids=position_ids, token_tags=tags, timestep_indices=levels,
                text_indices=torch.arange(nt), video_indices=torch.arange(nt, nt + nv),
                audio_indices=torch.arange(nt + nv, nt + nv + na))


def stream_request(call: dict) -> dict:
    """The "ids-float32" request of a packed sequence: ``img_ids`` the video rows' positions
    (in ``video_indices`` order), ``txt_ids`` the text rows' then the audio rows'."""
    pos = call["position_ids"]
    return {"img_ids": pos[call["video_indices"]],
            "txt_ids": torch.cat([pos[call["text_indices"]], pos[call["audio_indices"]]])}


def sample_request(record, img_shapes: Sequence[Sequence[int]], txt_len: int) -> dict:
    """The position request of a sample: the first grid's video rows and ``txt_len`` rows of
    the text stream (text and audio rows: ``(i, 0, 0)`` either way, :func:`packed_layout`)."""
    return stream_request(packed_layout(img_shapes[0], txt_len, 0))


def _index(value, name: str, rows: int) -> torch.Tensor:
    t = tensor_arg(value, name, 1, "[rows] of packed-row indices")
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise InputError(f"{name} must be an integer tensor; got {t.dtype}. Fix: pass int64 "
                         f"indices")
    if t.numel() and (int(t.min()) < 0 or int(t.max()) >= rows):
        raise InputError(f"{name} indexes rows outside the packed sequence of {rows} rows "
                         f"(position_ids' length). Fix: pass indices in [0, {rows})")
    return t.to(torch.int64).contiguous()


class MiniMaxH3Transformer(Transformer):
    """What a caller of ``MiniMaxH3Transformer3DModel`` passes (module docstring)."""

    FORWARD_ARGS = ("hidden_states", "audio_hidden_states", "encoder_hidden_states", "timestep",
                    "timestep_indices", "token_tags", "position_ids", "video_indices",
                    "audio_indices", "text_indices", "attention_kwargs", "return_dict")
    PIPELINES = "MiniMaxH3Transformer3DModel's own call (diffusers has no MiniMax-H3 pipeline)"

    def prepare(self, hidden_states=None, audio_hidden_states=None, encoder_hidden_states=None,
                timestep=None, timestep_indices=None, token_tags=None, position_ids=None,
                video_indices=None, audio_indices=None, text_indices=None,
                attention_kwargs=None, return_dict: bool = True) -> Call:
        refuse_kwargs(attention_kwargs, "attention_kwargs")
        given = dict(hidden_states=hidden_states, audio_hidden_states=audio_hidden_states,
                     encoder_hidden_states=encoder_hidden_states, timestep=timestep,
                     timestep_indices=timestep_indices, token_tags=token_tags,
                     position_ids=position_ids, video_indices=video_indices,
                     audio_indices=audio_indices, text_indices=text_indices)
        require_arguments(self.record.short, **given)
        video = tensor_arg(hidden_states, "hidden_states", 3, "[batch, video_rows, channels]")
        audio = tensor_arg(audio_hidden_states, "audio_hidden_states", 3,
                           "[batch, audio_rows, audio_channels]")
        text = tensor_arg(encoder_hidden_states, "encoder_hidden_states", 3,
                          "[batch, text_rows, text_dim]")
        if len({int(video.shape[0]), int(audio.shape[0]), int(text.shape[0])}) != 1:
            raise InputError(f"hidden_states, audio_hidden_states and encoder_hidden_states "
                             f"must share the batch; got {int(video.shape[0])}, "
                             f"{int(audio.shape[0])} and {int(text.shape[0])}")
        pos = tensor_arg(position_ids, "position_ids", 2, "[rows, 3] (t, h, w) per packed row")
        if pos.shape[1] != 3:
            raise InputError(f"position_ids must be [rows, 3]; got {list(pos.shape)}")
        rows = int(pos.shape[0])
        idx = {n: _index(given[n], n, rows) for n in ("video_indices", "audio_indices",
                                                       "text_indices", "timestep_indices",
                                                       "token_tags")}
        for name, stream in (("video_indices", video), ("audio_indices", audio),
                             ("text_indices", text)):
            if idx[name].shape[0] != stream.shape[1]:
                raise InputError(f"{name} has {idx[name].shape[0]} rows but its stream has "
                                 f"{int(stream.shape[1])}. Fix: one index per row")
        for name in ("timestep_indices", "token_tags"):
            if idx[name].shape[0] != rows:
                raise InputError(f"{name} must have one value per packed row ({rows}, "
                                 f"position_ids' length); got {idx[name].shape[0]}")
        filled = torch.cat([idx["text_indices"], idx["video_indices"], idx["audio_indices"]])
        if filled.shape[0] != rows or not torch.equal(filled.sort().values, torch.arange(rows)):
            raise InputError(
                f"the text, video and audio indices must fill each of the {rows} packed rows "
                f"exactly once (got {filled.shape[0]} indices"
                f"{', some repeated' if filled.unique().shape[0] != filled.shape[0] else ''}); "
                f"a row no stream fills is a zero row diffusers attends, which the exported "
                f"graph does not hold. Fix: pack only text, video and audio rows")
        levels = tensor_arg(timestep, "timestep", 1, "[noise_levels] distinct timestep values")
        if levels.numel() == 0 or int(idx["timestep_indices"].max()) >= levels.shape[0]:
            raise InputError(f"timestep_indices name level "
                             f"{int(idx['timestep_indices'].max())} but timestep has "
                             f"{levels.shape[0]} values {short_repr(levels.tolist(), 60)}")
        request = stream_request(dict(position_ids=pos, **idx))
        conditioning = dict(audio_hidden_states=audio.to(self.dtype),
                            timestep_indices=idx["timestep_indices"],
                            token_tags=idx["token_tags"], video_indices=idx["video_indices"],
                            audio_indices=idx["audio_indices"],
                            text_indices=idx["text_indices"])
        return Call(video.to(self.dtype), text.to(self.dtype), request,
                    timestep=levels.to(torch.float32), conditioning=conditioning,
                    return_dict=return_dict)

    def output(self, sample, return_dict: bool):
        """diffusers' ``MiniMaxH3TransformerOutput(sample, audio_sample)``, or the pair."""
        video, audio = sample
        if not return_dict:
            return (video, audio)
        from diffusers.models.transformers.transformer_minimax_h3 import (
            MiniMaxH3TransformerOutput)

        return MiniMaxH3TransformerOutput(sample=video, audio_sample=audio)


def dropin_class(record):
    """The drop-in class of ``record`` (the registry's entry point)."""
    return MiniMaxH3Transformer


__all__ = ["MiniMaxH3Transformer", "dropin_class", "packed_layout", "sample_request",
           "stream_request"]
