"""Ideogram 4's part of the pipeline drop-in (runtime layer). ``Ideogram4Pipeline`` calls both
``pipe.transformer`` and ``pipe.unconditional_transformer`` with ``hidden_states [B, L, C],
timestep [B], encoder_hidden_states [B, L, F], position_ids [B, L, 3], segment_ids [B, L],
indicator [B, L]`` over its packed ``[left padding][text][image]`` sequence (the unconditional
call: the image alone). :class:`Ideogram4Transformer` reads the layout off ``indicator`` (image
tokens 2 as the suffix of every item, text 3, padding anything else) and ``segment_ids``
(text and image one segment, padding another), passes the image latents and the text region
with its mask, and asks the "ids" scheme for the caches of the call's positions: the float32
angles diffusers' ``Ideogram4MRoPE`` computes, one "axis" per pair (the record's docstring).
Items whose ``position_ids`` differ (prompts of different lengths) run as one graph call per
group of equal ones, stacked back into the batch (docs/spec.md section 6c). An image-only call
gets one padding token as its text region (its own segment: no image token sees it).

The sample is diffusers' ``[B, L, C]``: the image rows are the graph's, the text-region rows
zeros (diffusers computes values there that the pipeline discards). Refused in one line:
``attention_kwargs`` other than a LoRA scale of 1, a per-token timestep, and layouts the
pipeline does not make (several samples packed in one row, padding in the text or image
segment, image tokens that are not the suffix).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from qkrope.errors import InputError
from qkrope.families._contract import DropinHooks as CONTRACT  # noqa: F401
from qkrope.runtime._dropin import (Call, Split, Transformer, per_item, require_arguments,
                                    refuse_kwargs, tensor_arg)

#: diffusers' values (transformer_ideogram4): the indicator of a text and of an image token,
#: and the offset of the image positions.
TEXT, IMAGE, IMAGE_OFFSET = 3, 2, 65536
#: diffusers' default config: what a request is built for where no config is given.
DEFAULTS = {"attention_head_dim": 256, "rope_theta": 5_000_000, "mrope_section": (24, 20, 20)}


def angles(position_ids: torch.Tensor, config: Mapping) -> torch.Tensor:
    """The float32 RoPE angles ``[tokens, head_dim / 2]`` of ``position_ids [tokens, 3]`` as
    diffusers' ``Ideogram4MRoPE`` computes them: float32 frequencies ``1 / theta ** (2j / D)``,
    their float32 products with the t, h and w positions, then pair j takes axis 1 where
    j mod 3 = 1 and j < 3·section[1], axis 2 where j mod 3 = 2 and j < 3·section[2], else
    axis 0."""
    cfg = {**DEFAULTS, **{k: v for k, v in dict(config).items() if k in DEFAULTS}}
    head_dim, section = int(cfg["attention_head_dim"]), tuple(cfg["mrope_section"])
    inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32)
                                       / head_dim))
    pos = position_ids.detach().to("cpu", torch.float32).permute(1, 0).unsqueeze(1)  # [3, 1, L]
    with torch.autocast(device_type="cpu", enabled=False):
        freqs = (inv[None, :, None].expand(3, -1, 1) @ pos).transpose(1, 2)  # [3, L, D/2]
    out = freqs[0].clone()
    for axis in (1, 2):
        idx = torch.arange(axis, 3 * int(section[axis]), 3)
        out[:, idx] = freqs[axis][:, idx]
    return out.contiguous()


def request(position_ids: torch.Tensor, txt: int, config: Mapping) -> dict:
    """The "ids" request of one item's ``position_ids [L, 3]`` whose first ``txt`` tokens are
    the text region (at least one row: an image-only call's is one padding token at 0)."""
    a = angles(position_ids, config)
    text = a[:txt] if txt > 0 else torch.zeros(1, a.shape[1], dtype=torch.float32)
    return {"txt_ids": text, "img_ids": a[txt:]}


def layout_positions(h: int, w: int, txt_len: int, pad: int = 0) -> torch.Tensor:
    """``position_ids [txt_len + h * w, 3]`` as the pipeline lays out one item: ``pad`` padding
    tokens at 0, text token i at (i, i, i), image patch (y, x) at (65536, 65536 + y,
    65536 + x) in row-major order."""
    ys, xs = torch.meshgrid(torch.arange(int(h)), torch.arange(int(w)), indexing="ij")
    image = torch.stack([torch.zeros(h * w, dtype=torch.int64), ys.reshape(-1),
                         xs.reshape(-1)], dim=1) + IMAGE_OFFSET
    text = torch.arange(int(txt_len) - int(pad)).unsqueeze(1).expand(-1, 3)
    return torch.cat([torch.zeros(int(pad), 3, dtype=torch.int64), text, image])


def layout_request(config: Mapping, h: int, w: int, txt_len: int, pad: int = 0) -> dict:
    """The request of :func:`layout_positions` for a model of this diffusers ``config``."""
    return request(layout_positions(h, w, txt_len, pad), int(txt_len), config)


def sample_request(record, img_shapes: Sequence[Sequence[int]], txt_len: int) -> dict:
    """The position request of a sample of these sizes for diffusers' default config (the
    first grid ``(1, h, w)``, ``txt_len`` text tokens, none padding);
    :func:`model_request` for another config."""
    return model_request(record, DEFAULTS, img_shapes, txt_len)


def model_request(record, config: Mapping, img_shapes: Sequence[Sequence[int]],
                  txt_len: int) -> dict:
    """The position request of a sample of these sizes for a model of this diffusers
    ``config`` (the angles depend on its head width, theta and mrope_section)."""
    _, h, w = (int(v) for v in img_shapes[0])
    return layout_request(config, h, w, max(int(txt_len), 1))


def _layout(indicator: torch.Tensor, segment_ids: torch.Tensor, length: int) -> tuple:
    """(text-region tokens, the int64 text mask [B, txt]) of the pipeline's layout, or a
    one-line refusal of another."""
    fix = ("Fix: pass the indicator / segment_ids Ideogram4Pipeline builds ([left padding]"
           "[text][image], the padding in a segment of its own)")
    image = indicator == IMAGE
    txt = length - int(image[0].sum())
    if txt == length or not bool(image[:, txt:].all()) or bool(image[:, :txt].any()):
        raise InputError(f"indicator must mark image tokens ({IMAGE}) as the same-length suffix "
                         f"of every item; got another layout. {fix}")
    text = indicator[:, :txt] == TEXT
    for seg, real in zip(segment_ids.detach().cpu(), text.cpu()):
        main = seg[-1]
        if not bool((seg[txt:] == main).all()) or not bool((seg[:txt][real] == main).all()):
            raise InputError(f"segment_ids must put each item's text and image in one segment "
                             f"(several samples packed in one row are not served). {fix}")
        pads = seg[:txt][~real]
        if pads.numel() and (bool((pads == main).any()) or not bool((pads == pads[0]).all())):
            raise InputError(f"segment_ids must put each item's padding tokens in one segment "
                             f"of their own. {fix}")
    return txt, text.to(torch.int64)


class Ideogram4Transformer(Transformer):
    """What Ideogram4Pipeline calls on ``pipe.transformer`` and
    ``pipe.unconditional_transformer`` (module docstring)."""

    FORWARD_ARGS = ("hidden_states", "timestep", "encoder_hidden_states", "position_ids",
                    "segment_ids", "indicator", "attention_kwargs", "return_dict")
    PIPELINES = "Ideogram4Pipeline"

    def prepare(self, hidden_states=None, timestep=None, encoder_hidden_states=None,
                position_ids=None, segment_ids=None, indicator=None, attention_kwargs=None,
                return_dict: bool = True) -> "Call | Split":
        refuse_kwargs(attention_kwargs, "attention_kwargs")
        require_arguments(self.record.short, hidden_states=hidden_states, timestep=timestep,
                          encoder_hidden_states=encoder_hidden_states,
                          position_ids=position_ids, segment_ids=segment_ids,
                          indicator=indicator)
        channels, features = self.config.get("in_channels"), self.config.get("llm_features_dim")
        tensor_arg(hidden_states, "hidden_states", 3, f"[batch, tokens, {channels}]")
        batch, length = (int(v) for v in hidden_states.shape[:2])
        tensor_arg(encoder_hidden_states, "encoder_hidden_states", 3,
                   f"[batch, tokens, {features}]")
        tensor_arg(position_ids, "position_ids", 3, "[batch, tokens, 3]")
        for name, value in (("segment_ids", segment_ids), ("indicator", indicator)):
            tensor_arg(value, name, 2, "[batch, tokens]")
        shapes = {"encoder_hidden_states": tuple(encoder_hidden_states.shape[:2]),
                  "position_ids": tuple(position_ids.shape), "segment_ids":
                  tuple(segment_ids.shape), "indicator": tuple(indicator.shape)}
        want = {"encoder_hidden_states": (batch, length), "position_ids": (batch, length, 3),
                "segment_ids": (batch, length), "indicator": (batch, length)}
        bad = [f"{n} {list(s)}" for n, s in shapes.items() if s != want[n]]
        if bad:
            raise InputError(f"hidden_states is [batch={batch}, tokens={length}, ...] but "
                             f"{', '.join(bad)}. Fix: pass the packed sequence's tensors of "
                             f"one length, as the pipeline does")
        if isinstance(timestep, torch.Tensor) and timestep.dim() > 1:
            raise InputError(f"timestep {list(timestep.shape)} is per token; the export takes "
                             f"one timestep per item. Fix: pass a [batch] timestep, as the "
                             f"pipeline does")
        timestep = per_item(timestep, "timestep", batch, torch.float32)
        txt, mask = _layout(indicator, segment_ids, length)
        image = hidden_states[:, txt:].to(self.dtype)
        if txt:
            text = encoder_hidden_states[:, :txt].to(self.dtype)
        else:  # the image-only call: one padding token, a segment of its own
            text = image.new_zeros(batch, 1, int(encoder_hidden_states.shape[-1]))
            mask = torch.zeros(batch, 1, dtype=torch.int64, device=mask.device)
        cfg = dict(self.config)
        groups: dict[bytes, list[int]] = {}
        positions = position_ids.detach().to("cpu", torch.int64)
        for i in range(batch):
            groups.setdefault(positions[i].numpy().tobytes(), []).append(i)

        def unpack(sample: torch.Tensor) -> torch.Tensor:
            return torch.cat([sample.new_zeros(sample.shape[0], txt, sample.shape[2]), sample],
                             dim=1)

        calls = [Call(image[index], text[index], request(positions[index[0]], txt, cfg),
                      timestep=timestep[index].to(image.device), mask=mask[index],
                      return_dict=return_dict, unpack=unpack,
                      items=None if len(groups) == 1 else tuple(index))
                 for index in groups.values()]
        if len(calls) == 1:
            return calls[0]
        return Split(calls, batch, return_dict=return_dict, stack=True)


def dropin_class(record):
    """The drop-in class of ``record`` (the registry's entry point)."""
    return Ideogram4Transformer


__all__ = ["Ideogram4Transformer", "angles", "dropin_class", "layout_positions",
           "layout_request", "model_request", "request", "sample_request"]
