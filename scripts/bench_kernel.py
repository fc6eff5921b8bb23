#!/usr/bin/env python
"""Bandwidth benchmark of the fused QKNormRoPE CUDA kernel at Qwen-Image shapes.

Compares, per call (one stream of one transformer block):
  fused     libqkrope_kernels.so through qkrope.runtime.kernels.cuda_qk_norm_rope
  eager     qkrope.export.qk_norm_rope_reference in PyTorch eager mode
  compile   torch.compile of the same reference (static shapes)

Shapes: 512x512 (1024 image tokens) and 1024x1024 (4096 image tokens) plus 512 text tokens,
batch 1 and 2, 24 heads x 128, bf16 activations and weights, fp32 cache.
Timing: CUDA events around each call, L2 flushed before every call (so small shapes do not run
from L2), warm-up first, median over the timed calls.
Bytes moved = read q, k + write q_out, k_out + both weights + the cache rows used.

    python scripts/bench_kernel.py [--iters 100] [--json out.json] [--no-compile] [--peak-tbs 4.8]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

HEADS, HEAD_DIM = 24, 128
TXT_TOKENS = 512
RESOLUTIONS = {"512x512": 1024, "1024x1024": 4096}  # image tokens (16x16 pixels per token)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=100, help="timed calls per measurement")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--json", type=Path, default=None,
                    help="where to write the results (default $OUT/bench_kernel.json or "
                         "build/bench_kernel.json)")
    ap.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    ap.add_argument("--peak-tbs", type=float, default=4.8, help="peak HBM bandwidth in TB/s")
    ap.add_argument("--rounding", type=int, default=0, choices=(0, 1))
    args = ap.parse_args(argv)

    import torch
    if not torch.cuda.is_available():
        print("bench_kernel: no CUDA device visible to PyTorch (torch.cuda.is_available() is False); "
              "run this on a machine with an NVIDIA GPU and a CUDA build of PyTorch.",
              file=sys.stderr)
        return 2

    from qkrope.export import qk_norm_rope_reference
    from qkrope.runtime import kernels

    dev = torch.device("cuda")
    gpu = torch.cuda.get_device_name(dev)
    peak = args.peak_tbs * 1e12
    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device=dev)  # > any GPU's L2

    def timed(fn) -> float:
        for _ in range(args.warmup):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(args.iters):
            flush.zero_()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e-3)
        return statistics.median(times)

    compiled = None
    if not args.no_compile:
        compiled = torch.compile(qk_norm_rope_reference, dynamic=False)

    rows = []
    for res, img_tokens in RESOLUTIONS.items():
        for batch in (1, 2):
            for stream, seq in (("img", img_tokens), ("txt", TXT_TOKENS)):
                g = torch.Generator(device=dev).manual_seed(0)
                shape = (batch, seq, HEADS, HEAD_DIM)
                q = torch.randn(shape, generator=g, device=dev).to(torch.bfloat16)
                k = torch.randn(shape, generator=g, device=dev).to(torch.bfloat16)
                qw = (torch.rand(HEAD_DIM, generator=g, device=dev) + 0.5).to(torch.bfloat16)
                kw = (torch.rand(HEAD_DIM, generator=g, device=dev) + 0.5).to(torch.bfloat16)
                ang = torch.rand(seq, HEAD_DIM // 2, generator=g, device=dev) * 6.0
                cache = torch.cat([ang.cos(), ang.sin()], -1).contiguous()
                kw_ = dict(eps=1e-6, interleaved=True, rounding=args.rounding)
                q_out, k_out = torch.empty_like(q), torch.empty_like(k)

                nbytes = (4 * q.numel() * q.element_size() + 2 * HEAD_DIM * 2
                          + seq * HEAD_DIM * 4)
                entry = {"resolution": res, "batch": batch, "stream": stream, "tokens": seq,
                         "bytes": nbytes}

                fused = lambda: kernels.cuda_qk_norm_rope(q, k, qw, kw, cache, out=(q_out, k_out), **kw_)  # noqa: E731
                eager = lambda: qk_norm_rope_reference(q, k, qw, kw, cache, **kw_)  # noqa: E731
                # correctness guard before timing
                fused()
                ref = eager()
                err = max((a.float() - b.float()).abs().max().item() for a, b in zip((q_out, k_out), ref))
                entry["max_abs_diff_vs_eager"] = err

                for name, fn in (("fused", fused), ("eager", eager)):
                    entry[f"{name}_us"] = timed(fn) * 1e6
                if compiled is not None:
                    try:
                        t0 = time.perf_counter()
                        compiled(q, k, qw, kw, cache, **kw_)
                        torch.cuda.synchronize()
                        entry["compile_s"] = time.perf_counter() - t0
                        entry["compile_us"] = timed(lambda: compiled(q, k, qw, kw, cache, **kw_)) * 1e6
                    except Exception as exc:  # noqa: BLE001 - report and continue
                        entry["compile_error"] = f"{type(exc).__name__}: {exc}"[:300]
                for name in ("fused", "eager", "compile"):
                    us = entry.get(f"{name}_us")
                    if us:
                        entry[f"{name}_gbs"] = nbytes / (us * 1e-6) / 1e9
                        entry[f"{name}_pct_peak"] = 100.0 * nbytes / (us * 1e-6) / peak
                rows.append(entry)
                del q, k, q_out, k_out, ref

    hdr = (f"{'shape':<10} {'B':>1} {'strm':<4} {'tok':>5} {'MB':>6} | {'fused us':>8} {'GB/s':>6} "
           f"{'%pk':>5} | {'eager us':>8} {'%pk':>5} | {'compile us':>10} {'%pk':>5} | "
           f"{'vs eager':>8} {'vs comp':>7}")
    print(f"GPU: {gpu}; peak {args.peak_tbs} TB/s; bf16, {HEADS} heads x {HEAD_DIM}, fp32 cache, "
          f"rounding={args.rounding}; median of {args.iters} calls, L2 flushed before each")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        comp_us = r.get("compile_us")
        print(f"{r['resolution']:<10} {r['batch']:>1} {r['stream']:<4} {r['tokens']:>5} "
              f"{r['bytes'] / 1e6:>6.1f} | {r['fused_us']:>8.1f} {r['fused_gbs']:>6.0f} "
              f"{r['fused_pct_peak']:>5.1f} | {r['eager_us']:>8.1f} {r['eager_pct_peak']:>5.1f} | "
              + (f"{comp_us:>10.1f} {r['compile_pct_peak']:>5.1f} | " if comp_us else
                 f"{'n/a':>10} {'':>5} | ")
              + f"{r['eager_us'] / r['fused_us']:>7.2f}x "
              + (f"{comp_us / r['fused_us']:>6.2f}x" if comp_us else f"{'n/a':>7}"))
    # per transformer block (img + txt call) at each resolution/batch
    print("\nper block (img + txt):")
    for res in RESOLUTIONS:
        for batch in (1, 2):
            sel = [r for r in rows if r["resolution"] == res and r["batch"] == batch]
            us = sum(r["fused_us"] for r in sel)
            nb = sum(r["bytes"] for r in sel)
            print(f"  {res} B={batch}: {nb / 1e6:.1f} MB, fused {us:.1f} us, "
                  f"{nb / (us * 1e-6) / 1e9:.0f} GB/s = {100 * nb / (us * 1e-6) / peak:.1f}% of peak")

    out = args.json
    if out is None:
        base = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(__file__).resolve().parent.parent / "build"
        out = base / "bench_kernel.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"gpu": gpu, "peak_tbs": args.peak_tbs, "iters": args.iters,
                               "rounding": args.rounding, "torch": torch.__version__,
                               "rows": rows}, indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
