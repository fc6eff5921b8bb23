"""ERNIE-Image (qkrope/families/ernie_image): refused by class. Its RoPE repeats each angle in
place but rotates split halves, so the two elements of a pair turn by different angles: checked
here on diffusers' own embedder and rotation (the reason stands only while it holds), and the
refusal is one line with that reason."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")

from qkrope import families  # noqa: E402
from qkrope.errors import InputError  # noqa: E402


def test_its_rope_turns_a_pair_by_two_angles():
    """diffusers' ErnieImageEmbedND3 at the default config (head 128, axes (32, 48, 48)): every
    pair (i, i + 64) of the split-halves rotation has two different angles, so the processor's
    rotation of a unit vector changes its norm: no rotation, no QKNormRoPE cache."""
    from diffusers.models.transformers.transformer_ernie_image import (
        ErnieImageEmbedND3, ErnieImageSingleStreamAttnProcessor)

    emb = ErnieImageEmbedND3(dim=128, theta=256, axes_dim=(32, 48, 48))
    freqs = emb(torch.tensor([[[7.0, 3.0, 5.0]]]))  # [1, 1, 1, 128]
    angles = freqs[0, 0, 0]
    assert bool((angles[:64] != angles[64:]).all())

    class _Attn(torch.nn.Module):  # the processor's projections as identities, no norm
        heads, norm_q, norm_k = 1, None, None

        def __init__(self):
            super().__init__()
            self.to_q = self.to_k = self.to_v = torch.nn.Identity()
            self.to_out = torch.nn.ModuleList([torch.nn.Identity()])

    seen = {}
    import diffusers.models.transformers.transformer_ernie_image as ernie

    def capture(q, k, v, **kwargs):
        seen["q"] = q
        return v
    original = ernie.dispatch_attention_fn
    ernie.dispatch_attention_fn = capture
    try:
        x = torch.zeros(1, 1, 128, dtype=torch.float64)
        x[..., 0] = 1.0  # a unit vector on the first element of pair (0, 64)
        ErnieImageSingleStreamAttnProcessor()(_Attn(), x, freqs_cis=freqs.double())
    finally:
        ernie.dispatch_attention_fn = original
    norm = float(seen["q"].norm())
    a, b = float(angles[0]), float(angles[64])
    # in float64, as the processor ran (torch.tensor(a) would be float32: 6e-8 apart)
    assert abs(norm - math.sqrt(math.cos(a) ** 2 + math.sin(b) ** 2)) < 1e-12
    assert abs(norm - 1.0) > 1e-3


def test_the_class_is_refused_in_one_line_with_its_reason():
    with pytest.raises(InputError, match="two different angles") as e:
        families.family_of({"_class_name": "ErnieImageTransformer2DModel"})
    assert "\n" not in str(e.value) and "ErnieImageTransformer2DModel" in str(e.value)
