"""The rows of ``qkrope bench``: a row from its timings, a skipped or failed row with its reason,
and a set of backends timed size by size, interleaved, into rows."""

from __future__ import annotations

from typing import Any, Callable, Mapping

from ..measure import BenchRow, image_tokens, summarize, time_interleaved
from .config import Config


REQUIRES_CUDA = "requires CUDA (no GPU visible to torch)"
REQUIRES_TRT = "requires TensorRT (Python package 'tensorrt' not importable)"


Key = tuple  # (backend, attention form or "") of one series of rows


def _row(cfg: Config, backend: str, size: int, batch: int, machine: dict, **kw) -> BenchRow:
    if "threads" not in kw:
        t = machine.get("cpu_threads")
        kw["threads"] = int(t) if t not in (None, "") else None
    return BenchRow(backend=backend, size=size, img_tokens=image_tokens(size), txt_tokens=cfg.text_len,
               batch=batch, dtype=cfg.dtype, device=machine.get("gpu") or machine.get("cpu", ""),
               machine=machine, **kw)


def _measured(cfg: Config, key: Key, size: int, batch: int, machine: dict,
              times: list[float], **kw) -> BenchRow:
    st = summarize(times)
    return _row(cfg, key[0], size, batch, machine, attention=key[1], median_ms=st["median_ms"],
                p10_ms=st["p10_ms"], p90_ms=st["p90_ms"], iters=int(st["n"]), **kw)


def _measure(cfg: Config, rows: list[BenchRow], machine: dict,
             backends: Mapping[Key, Callable[[int, int], Callable[[], Any]]],
             extras: Mapping[Key, dict] | None = None) -> None:
    """Measure ``backends`` size by size, interleaved (:func:`time_interleaved`)."""
    cuda = cfg.device.startswith("cuda")
    extras = extras or {}
    for size in cfg.sizes:
        for batch in cfg.batches:
            calls, failed = {}, {}
            for key, prepare in backends.items():
                try:
                    calls[key] = prepare(size, batch)
                except Exception as exc:  # noqa: BLE001 - a failed row must not end the bench
                    failed[key] = exc
            results = time_interleaved(calls, iters=cfg.iters, warmup=cfg.warmup, cuda=cuda)
            for key in backends:
                res = failed.get(key, results.get(key))
                extra = dict(extras.get(key, {}))
                if isinstance(res, BaseException):
                    rows.append(_row(cfg, key[0], size, batch, machine, attention=key[1],
                                     status="failed", reason=f"{type(res).__name__}: {res}"[:300],
                                     **extra))
                else:
                    rows.append(_measured(cfg, key, size, batch, machine, res, **extra))


def _skip_all(cfg: Config, rows: list[BenchRow], backend: str, reason: str, machine: dict,
              attention: str = "") -> None:
    for size in cfg.sizes:
        for batch in cfg.batches:
            rows.append(_row(cfg, backend, size, batch, machine, status="skipped", reason=reason,
                             attention=attention))
