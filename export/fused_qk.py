"""What every family's attention processor does around the node: read the epsilon of the
per-head RMSNorms the node replaces (one epsilon for q and k: one node has one), cache the node
attributes per epsilon, and call :func:`qkrope.export.ops.qk_norm_rope` with the module's own
norm weights (their dtype as they are: fp32 weights under bf16 activations included, spec 3.4).

The families' processors differ in where q, k and the cache come from and what follows; this is
the part they share (issue 44: shared code, not copies).
"""

from __future__ import annotations

import torch
from torch import nn

from qkrope import contract
from qkrope.errors import InputError

from .ops import qk_norm_rope


def check_cache(cache, who: str, name: str = "image_rotary_emb") -> None:
    """A patched processor's RoPE argument is the node's 2-D ``[rows, rotary_dim]`` cache (what
    the family's cache-input wrapper passes), else one line naming ``who``."""
    if not isinstance(cache, torch.Tensor) or cache.dim() != 2:
        raise InputError(f"the patched {who} attention needs {name} = the [rows, rotary_dim] "
                         f"cache; run it through the family's cache-input wrapper")


def norm_eps(norm: nn.Module, where: str) -> float:
    """The epsilon of a per-head RMSNorm the node replaces (it must have a weight)."""
    eps = getattr(norm, "eps", None)
    if eps is None or getattr(norm, "weight", None) is None:
        raise InputError(f"{where} ({type(norm).__name__}) has no epsilon or no weight "
                         f"(elementwise_affine=False, or not an RMSNorm), which the QKNormRoPE "
                         f"node needs; run this model on PyTorch")
    return float(eps)


def shared_eps(norm_q: nn.Module, norm_k: nn.Module,
               names: tuple[str, str] = ("norm_q", "norm_k")) -> float:
    """The one epsilon of a q/k norm pair (one node has one epsilon: they must agree)."""
    eps = norm_eps(norm_q, names[0])
    other = norm_eps(norm_k, names[1])
    if eps != other:
        raise InputError(f"{names[0]}'s eps {eps} and {names[1]}'s {other} differ; one "
                         f"QKNormRoPE node has one epsilon")
    return eps


def unfused_interleaved(q, k, norm_q: nn.Module, norm_k: nn.Module, cache):
    """diffusers' own norms, then its ``apply_rotary_emb`` of interleaved pairs with the node's
    cache rows (each angle's cos and sin repeated over its pair): the graph a family's tests
    export in place of the node to hold it to diffusers' order."""
    from diffusers.models.embeddings import apply_rotary_emb

    half = cache.shape[1] // 2
    rows = cache[:q.shape[1]]
    pair = (rows[:, :half].repeat_interleave(2, dim=1), rows[:, half:].repeat_interleave(2, dim=1))
    return (apply_rotary_emb(norm_q(q), pair, sequence_dim=1),
            apply_rotary_emb(norm_k(k), pair, sequence_dim=1))


class FusedNormRoPE:
    """One ``qk_norm_rope`` call per q/k pair, with the node attributes of the pair's epsilon,
    this ``rounding`` and pairing (``interleaved``: GPT-J pairs; False: NeoX halves).
    ``fused=False``: :func:`unfused_interleaved` instead (the tests' reference graph)."""

    def __init__(self, rounding: int, *, interleaved: bool = True, fused: bool = True):
        self.rounding = contract.check_rounding(rounding)
        self.interleaved = bool(interleaved)
        if not fused and not self.interleaved:
            raise ValueError("the unfused reference is diffusers' interleaved rotation")
        self.fused = bool(fused)
        self._attributes: dict[float, contract.NodeAttributes] = {}

    def attributes(self, eps: float) -> contract.NodeAttributes:
        """The node attributes at ``eps`` (created once per epsilon)."""
        if eps not in self._attributes:
            self._attributes[eps] = contract.NodeAttributes(eps, self.interleaved,
                                                            self.rounding)
        return self._attributes[eps]

    def __call__(self, q, k, norm_q: nn.Module, norm_k: nn.Module, cache,
                 names: tuple[str, str] = ("norm_q", "norm_k")):
        if not self.fused:
            return unfused_interleaved(q, k, norm_q, norm_k, cache)
        eps = shared_eps(norm_q, norm_k, names)
        return qk_norm_rope(q, k, norm_q.weight, norm_k.weight, cache,
                            **self.attributes(eps).as_kwargs())


class PatchedBlockList(nn.Module):
    """What a cache-input wrapper over one block list sets up: one processor (``processor``
    built with the checked ``rounding``) on every block's ``attention`` module of the
    transformer's ``blocks`` list, and the first ``kept`` blocks to run (every block by
    default); the family's wrapper subclasses it with its own ``forward``."""

    def __init__(self, transformer: nn.Module, family, rounding: int, kept: int | None, *,
                 blocks: str, attention: str, processor):
        super().__init__()
        self.family = family
        self.rounding = contract.check_rounding(rounding)
        listed = getattr(transformer, blocks)
        installed = processor(self.rounding)
        for block in listed:
            getattr(block, attention).set_processor(installed)
        self.transformer = transformer
        self.kept = len(listed) if kept is None else int(kept)


__all__ = ["check_cache", "norm_eps", "shared_eps", "unfused_interleaved", "FusedNormRoPE", "PatchedBlockList"]
