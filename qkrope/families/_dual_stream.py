"""What a dual-stream ("FLUX-like") family differs by, as data (root layer: no torch).

Every family whose diffusers transformer has FLUX's shape (``transformer_blocks`` of
double-stream blocks over an image and a text stream, then ``single_transformer_blocks`` over
the ``[text; image]`` sequence; attentions with FLUX's attribute layout; RoPE from position
ids, rotating the whole head) shares one export wrapper
(:mod:`qkrope.export.dual_stream`), one drop-in, one reference hook and one cache builder
(:mod:`qkrope.runtime.dual_stream`). A family states how it differs in a :class:`DualStream`
beside its record. A clone (LongCat-Image, Ovis-Image, Bria) sets it as its record's
``dual_stream`` and has no hook modules but its tiny builder: the registry
(:func:`qkrope.families.hooks`) gives it the shared ones, :data:`SHARED_HOOKS`, which read the
record's ``dual_stream``.
"""

from __future__ import annotations

from dataclasses import dataclass

from qkrope import contract
from qkrope.families._record import Launch

#: The tests' tiny dual-stream transformer (FLUX.1's diffusers test sizes: 1 + 1 blocks, 2 heads
#: x 16, RoPE axes (4, 4, 8), text width 32, 4 input channels); a family's tiny hook adds its
#: class's own fields.
TINY_CONFIG = dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                   attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                   axes_dims_rope=[4, 4, 8])

#: The shared hook modules of a dual-stream clone, by kind (each declares its kind's Protocol
#: as CONTRACT, qkrope.families._contract); a kind the clone's folder has a module for keeps it.
SHARED_HOOKS = {"export": "qkrope.export.dual_stream_hooks",
                "reference": "qkrope.runtime.dual_stream_reference",
                "dropin": "qkrope.runtime.dual_stream_dropin"}

#: how the model turns the timestep into the modulations' embedding (the module its forward
#: calls): ``time_text_embed(timestep[, guidance], pooled)``; ``time_guidance_embed(timestep,
#: guidance)``; ``time_embed(timestep, dtype)``; ``timestep_embedder(time_proj(timestep))``
TEMB_KINDS = ("time_text_embed", "time_guidance_embed", "time_embed", "time_proj")


@dataclass(frozen=True)
class IdsLayout:
    """How a family's pipelines lay out the position ids of a sample (what the export traces
    and ``qkrope check`` feeds; the drop-in takes whatever ids a pipeline passes): image k's
    patch at ``(image_first + k * image_step, row + image_offset, column + image_offset, 0...)``;
    a text token at 0 on every axis but ``text_axes``, which hold its index."""

    n_axes: int = 3
    image_step: int = 1
    text_axes: tuple[int, ...] = ()
    image_first: int = 0
    image_offset: int = 0


@dataclass(frozen=True)
class DualStream:
    """A dual-stream family's differences (module docstring).

    ``temb``: one of :data:`TEMB_KINDS`. ``context_norm``: a module applied to the text before
    ``context_embedder`` (None: none). ``ids``: the pipelines' id layout. ``single_pair``:
    whether the single-stream blocks take and return the (text, image) pair (FLUX.1's code) or
    the joined sequence. ``unguided_guidance``: what the drop-in does with a ``guidance`` value
    for a model exported without guidance embeddings: ``"refuse"`` (the model would use it) or
    ``"ignore"`` (diffusers' model ignores it too). ``forward_args`` and ``pipelines``: the
    stock forward's parameters and the pipelines that call it (the drop-in's).
    ``timestep_scale``: what the forward multiplies the timestep by before embedding it (1000:
    its pipelines pass t / 1000; 1: they pass the scheduler's timestep)."""

    temb: str
    ids: IdsLayout
    forward_args: tuple[str, ...]
    pipelines: str
    context_norm: str | None = None
    single_pair: bool = True
    unguided_guidance: str = "ignore"
    timestep_scale: float = 1000

    def __post_init__(self) -> None:
        if self.temb not in TEMB_KINDS:
            raise ValueError(f"DualStream.temb {self.temb!r} is not one of {TEMB_KINDS}")
        if self.unguided_guidance not in ("refuse", "ignore"):
            raise ValueError(f"DualStream.unguided_guidance {self.unguided_guidance!r}")


def launches(model: str, heads: int, image: int = 4096, text: int = 512) -> tuple:
    """A dual-stream model's node launches (x 128, interleaved pairs at full rotary width): a
    double-stream block's ``image`` and ``text`` tokens as two nodes, a single-stream block's
    joined ``image + text``; batch 1 and 2; planned in the two-steps rounding (the models'
    eager order: torch's RMSNorm, then the rotation in fp32) and the one-rounding mode."""
    return tuple(Launch(model, stream, seq, heads,
                        roundings=(contract.ROUNDING_TWO_STEPS, 0))
                 for stream, seq in ((f"image {image}", image), (f"text {text}", text),
                                     (f"single {image}+{text}", image + text)))


__all__ = ["TEMB_KINDS", "IdsLayout", "DualStream", "launches"]
