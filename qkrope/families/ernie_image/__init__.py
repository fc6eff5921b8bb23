"""ERNIE-Image (diffusers' ErnieImageTransformer2DModel): refused by class (:data:`REFUSED`); the
folder serves no record.

Its attention normalises q and k per head (``torch.nn.RMSNorm``, eps from the config) and then
applies a RoPE the QKNormRoPE node cannot express: ``ErnieImageEmbedND3`` builds each token's
``head_dim / 2`` angles (three axes: the text position or the image's text length, row,
column) and repeats every angle twice in place (``[a0, a0, a1, a1, ...]``), while the processor
rotates split halves (``x * cos + rotate_half(x) * sin``, ``rotate_half(x) = [-x2, x1]``).
Element ``i`` of the first half and its partner ``i + head_dim / 2`` thus take two different
angles (``a[i // 2]`` and ``a[head_dim / 4 + i // 2]``): the per-pair map is
``[[cos a, -sin a], [sin b, cos b]]`` with ``a != b``, not a rotation. The node turns each
pair by one angle (its cache holds one cos and one sin per pair), whichever pairing
(interleaved or halves) or cache it is given: checked on diffusers' own embedder, all 64 pairs
of a 128-wide head differ (the report of issue 44).
"""

from __future__ import annotations

RECORDS = ()

REFUSED = {
    "ErnieImageTransformer2DModel":
        "its RoPE repeats each angle in place ([a0, a0, a1, a1, ...]) but rotates split halves, "
        "so each pair (i, i + head_dim/2) is turned by two different angles, which is no "
        "rotation and which the node's one angle per pair cannot express",
}
