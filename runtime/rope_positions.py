"""Qwen-Image's RoPE position tables as numbers (no torch): which positions an image and a text
stream take, and whether they fit. diffusers' ``QwenEmbedRope`` tabulates positions 0..4095 (and
-4096..-1) per axis; :mod:`qkrope.runtime.caches` builds the caches from those tables and
``qkrope build`` bounds its profiles by them, both through the two functions here."""

from __future__ import annotations

from typing import Sequence

# diffusers tabulates positions 0..4095 (and -4096..-1) per axis.
QWEN_MAX_POSITIONS = 4096


def image_extent(frames_offset: int, shape: Sequence[int], scale_rope: bool = True) -> int:
    """The table entries image ``frames_offset`` of shape ``(f, h, w)`` (latent patches) needs
    per axis and direction: frames use positions k .. k+f-1; centred height/width use
    -(n - n//2) .. n//2 - 1, uncentred ones 0 .. n-1. It fits when this is <= 4096."""
    f, h, w = (int(v) for v in shape)
    extent = max(h - h // 2, w - w // 2) if scale_rope else max(h, w)
    return max(int(frames_offset) + f, extent)


def text_rows(shapes: Sequence[Sequence[int]], scale_rope: bool = True) -> int:
    """The text tokens the table leaves after these images: text token j sits at position
    offset + j, the offset set by the largest image, and the table ends at 4096."""
    offset = max(max(int(h) // 2, int(w) // 2) if scale_rope else max(int(h), int(w))
                 for _f, h, w in shapes)
    return QWEN_MAX_POSITIONS - offset
