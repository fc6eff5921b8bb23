"""The dtype a transformer is exported in when none is given: the checkpoint's
(:func:`checkpoint_dtype`), the dtype the weights are stored in, read from the safetensors
headers (nothing else is read).

A folder whose float tensors are stored in more than one dtype takes the dtype of the majority
of its float parameters (counted in elements; a tie goes to the wider type, fp32 before bf16
before fp16), and the reason says which dtypes it holds: diffusers keeps some modules in fp32
(``_keep_in_fp32_modules``), so a bf16 checkpoint with a few fp32 norms is a bf16 checkpoint. A
majority dtype qkrope does not export (float64, float8) gives fp32, and the reason says so.

No torch here: ``qkrope export`` decides before it imports torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from qkrope import dtypes

#: the order in which a tie between stored dtypes is broken (the wider first)
_TIE_ORDER = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class DtypeChoice:
    """The export dtype (``fp32``/``fp16``/``bf16``) and why it was chosen (one sentence)."""

    dtype: str
    reason: str
    #: the folder's float parameters by stored dtype (torch's name -> elements)
    stored: dict = field(default_factory=dict)


def checkpoint_dtype(diffusers_dir: str | os.PathLike, *, variant: str | None = None
                     ) -> DtypeChoice:
    """The dtype the folder's weights are stored in (see the module docstring for a mixed
    folder), from the safetensors headers (or the indexed shards' headers)."""
    from qkrope.diffusers_weights import tensor_headers

    counts: dict[str, int] = {}
    for header in tensor_headers(diffusers_dir, variant=variant).values():
        if header.is_floating_point:
            n = 1
            for d in header.shape:
                n *= int(d)
            counts[header.dtype] = counts.get(header.dtype, 0) + n
    where = f"--diffusers {diffusers_dir}" + (f" (variant {variant})" if variant else "")
    if not counts:
        return DtypeChoice("fp32", f"{where} stores no floating-point tensors; fp32 is the "
                                   f"exporter's fallback", counts)
    total = sum(counts.values())

    def rank(name: str) -> tuple:
        short = dtypes.SHORT_BY_NAME.get(name)
        tie = _TIE_ORDER.index(short) if short in _TIE_ORDER else len(_TIE_ORDER)
        return (-counts[name], tie, name)

    ordered = sorted(counts, key=rank)
    top = ordered[0]
    short = dtypes.SHORT_BY_NAME.get(top)
    if len(ordered) == 1:
        stored = f"every float tensor of {where} is stored in {top}"
    else:
        shares = ", ".join(f"{100 * counts[n] / total:.3g}% {n}" for n in ordered)
        stored = (f"{where} stores its float parameters in more than one dtype ({shares}); "
                  f"the majority is {top}")
    if short is None:
        return DtypeChoice("fp32", f"{stored}, which qkrope does not export; fp32 chosen",
                           counts)
    return DtypeChoice(short, f"{stored}: the checkpoint's dtype", counts)


def resolve_dtype(dtype: str | None, diffusers_dir: str | os.PathLike, *,
                  variant: str | None = None) -> DtypeChoice:
    """``dtype`` as given (checked), or the checkpoint's when None."""
    if dtype is None:
        return checkpoint_dtype(diffusers_dir, variant=variant)
    if dtype not in dtypes.NAME_BY_SHORT:
        from qkrope.errors import InputError

        raise InputError(f"--dtype must be one of {sorted(dtypes.NAME_BY_SHORT)}; got "
                         f"{dtype!r}. Fix: leave it out for the checkpoint's dtype")
    return DtypeChoice(dtype, "as given (--dtype)")


__all__ = ["DtypeChoice", "checkpoint_dtype", "resolve_dtype"]
