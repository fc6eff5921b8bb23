"""Values a target cannot hold, refused where they enter (one home for ``qkrope export``,
``qkrope quantize`` and ``qkrope refit``).

A weight is written in the target's dtype: NaN or infinite values in it as given are refused, and
so are finite values the conversion makes infinite (float32 beyond float16's range, 65504, when
the target is fp16). A calibrated FP8 amax must be a finite positive number: the scale of its
quantised input is ``amax / 448``, a NaN or infinite one makes every output after it NaN.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from qkrope.errors import InputError


class WeightValueError(InputError):
    """A weight or calibrated amax holds values the target cannot hold."""


#: elements checked at a time: the masks of a check stay a few MiB whatever the tensor's size
#: (the streamed export's peak memory is about one tensor)
CHUNK = 1 << 22


def nonfinite(t) -> int:
    """How many of ``t``'s values are NaN or infinite (0 for an integer tensor), in chunks of
    :data:`CHUNK` elements."""
    import torch

    if not t.is_floating_point():
        return 0
    flat = t.detach().reshape(-1)
    bad = 0
    for i in range(0, flat.numel(), CHUNK):
        chunk = flat[i:i + CHUNK]
        if not bool(torch.isfinite(chunk).all()):
            bad += int((~torch.isfinite(chunk)).sum())
    return bad


def dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def cast_problem(t, dtype) -> tuple[Any, str | None]:
    """``(t in dtype, None)``, or ``(t, what is wrong)``: NaN/inf values as given, or values the
    conversion to ``dtype`` makes infinite (one line, without the tensor's name)."""
    import torch

    bad = nonfinite(t)
    if bad:
        return t, f"{bad} of {t.numel()} values are NaN or infinite"
    if t.dtype == dtype:
        return t, None
    out = t.to(dtype)
    bad = nonfinite(out)
    if bad:
        big = float(t.detach().abs().max().to(torch.float64))
        limit = float(torch.finfo(dtype).max) if dtype.is_floating_point else None
        held = f", {dtype_name(dtype)} holds {limit:g}" if limit is not None else ""
        return t, (f"{bad} of {t.numel()} values are beyond {dtype_name(dtype)}'s range "
                   f"(largest |value| {big:.6g}{held}) and would become infinite")
    return out, None


#: overflowing tensors a message names before it counts the rest
NAMED = 5


def overflows(t, dtype) -> bool:
    """Whether finite values of ``t`` become infinite in ``dtype`` (NaN/inf as given: False)."""
    if t.dtype == dtype or not t.is_floating_point() or nonfinite(t):
        return False
    return bool(nonfinite(t.to(dtype)))


def checked_cast(t, dtype, *, name: str, source: str, dtype_flag: str | None = "--dtype",
                 others: Callable[[], Sequence[str]] | None = None):
    """``t`` in ``dtype``, or a :class:`WeightValueError` naming ``name`` (of ``source``) and the
    fix: for an overflow, ``dtype_flag`` bf16 (float32's range) or fp32. On an overflow,
    ``others()`` (when given) names the other tensors that overflow too, so one message lists
    every tensor the dtype cannot hold (the first :data:`NAMED`, then a count)."""
    out, problem = cast_problem(t, dtype)
    if problem is None:
        return out
    if "NaN or infinite" in problem:
        fix = ("the weights are damaged: pass weights whose values are finite (re-save or "
               "download them again)")
        raise WeightValueError(f"{source}: {name}: {problem}. Fix: {fix}")
    fix = (f"export with {dtype_flag} bf16 (float32's range) or {dtype_flag} fp32"
           if dtype_flag else "use a wider dtype (bf16 or fp32)")
    rest = [n for n in (others() if others is not None else ()) if n != name]
    if not rest:
        raise WeightValueError(f"{source}: {name}: {problem}. Fix: {fix}")
    listed = ", ".join(rest[:NAMED - 1]) + (f" (+{len(rest) - NAMED + 1} more)"
                                            if len(rest) > NAMED - 1 else "")
    raise WeightValueError(f"{source}: {1 + len(rest)} tensors have values beyond "
                           f"{dtype_name(dtype)}'s range: {name}: {problem}; also {listed}. "
                           f"Fix: {fix}")


def amax_problem(amax) -> str | None:
    """What is wrong with a calibrated amax (NaN, infinite, zero or negative), or None."""
    import torch

    a = amax.detach().to("cpu", torch.float64).reshape(-1)
    if not bool(torch.isfinite(a).all()):
        return f"a NaN or infinite amax ({float(a[~torch.isfinite(a)][0])})"
    if bool((a <= 0).any()):
        return f"an amax of {float(a[a <= 0][0]):g} (an amax must be > 0)"
    return None


__all__ = ["WeightValueError", "nonfinite", "overflows", "cast_problem", "checked_cast",
           "amax_problem",
           "dtype_name"]
