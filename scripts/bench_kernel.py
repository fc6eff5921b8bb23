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

    out = args.json
    if out is None:
        base = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(__file__).resolve().parent.parent / "build"
        out = base / "bench_kernel.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []

    def save(phase: str) -> None:
        # Rewritten after every measurement (atomically), so a timeout (scripts/gpu_check.sh runs
        # this under `timeout`) never loses what was already measured.
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps({"gpu": gpu, "peak_tbs": args.peak_tbs, "iters": args.iters,
                                   "rounding": args.rounding, "torch": torch.__version__,
                                   "phase": phase, "rows": rows}, indent=2))
        os.replace(tmp, out)

    def add_rates(entry) -> None:
        for name in ("fused", "eager", "compile"):
            us = entry.get(f"{name}_us")
            if us:
                entry[f"{name}_gbs"] = entry["bytes"] / (us * 1e-6) / 1e9
                entry[f"{name}_pct_peak"] = 100.0 * entry["bytes"] / (us * 1e-6) / peak

    kw_ = {"eps": 1e-6, "interleaved": True, "rounding": args.rounding}

    def make_case(seq: int, batch: int):
        g = torch.Generator(device=dev).manual_seed(0)
        shape = (batch, seq, HEADS, HEAD_DIM)
        q = torch.randn(shape, generator=g, device=dev).to(torch.bfloat16)
        k = torch.randn(shape, generator=g, device=dev).to(torch.bfloat16)
        qw = (torch.rand(HEAD_DIM, generator=g, device=dev) + 0.5).to(torch.bfloat16)
        kw = (torch.rand(HEAD_DIM, generator=g, device=dev) + 0.5).to(torch.bfloat16)
        ang = torch.rand(seq, HEAD_DIM // 2, generator=g, device=dev) * 6.0
        cache = torch.cat([ang.cos(), ang.sin()], -1).contiguous()
        return q, k, qw, kw, cache

    cases = [(res, img_tokens if stream == "img" else TXT_TOKENS, batch, stream)
             for res, img_tokens in RESOLUTIONS.items() for batch in (1, 2)
             for stream in ("img", "txt")]

    # Phase 1: fused and eager for every shape (cheap, and what matters), each row printed and
    # saved as soon as it is measured.
    print(f"GPU: {gpu}; phase 1: fused and eager (phase 2: torch.compile"
          f"{', skipped' if args.no_compile else ''})", flush=True)
    for res, seq, batch, stream in cases:
        q, k, qw, kw, cache = make_case(seq, batch)
        q_out, k_out = torch.empty_like(q), torch.empty_like(k)
        nbytes = (4 * q.numel() * q.element_size() + 2 * HEAD_DIM * 2 + seq * HEAD_DIM * 4)
        entry = {"resolution": res, "batch": batch, "stream": stream, "tokens": seq, "bytes": nbytes}
        args_ = (q, k, qw, kw, cache)

        def fused(args_=args_, out_=(q_out, k_out)):
            return kernels.cuda_qk_norm_rope(*args_, out=out_, **kw_)

        def eager(args_=args_):
            return qk_norm_rope_reference(*args_, **kw_)

        # correctness guard before timing
        fused()
        ref = eager()
        entry["max_abs_diff_vs_eager"] = max((a.float() - b.float()).abs().max().item()
                                             for a, b in zip((q_out, k_out), ref))
        for name, fn in (("fused", fused), ("eager", eager)):
            entry[f"{name}_us"] = timed(fn) * 1e6
        add_rates(entry)
        rows.append(entry)
        save("fused+eager")
        print(f"  measured {res} B={batch} {stream} {seq} tokens: fused {entry['fused_us']:.1f} us "
              f"({entry['fused_pct_peak']:.1f}% of peak), eager {entry['eager_us']:.1f} us, "
              f"max |diff| {entry['max_abs_diff_vs_eager']:.3g}", flush=True)
        del q, k, q_out, k_out, ref, args_, fused, eager

    # Phase 2: torch.compile (slow to compile; may be cut off by a timeout without losing phase 1).
    if not args.no_compile:
        compiled = torch.compile(qk_norm_rope_reference, dynamic=False)
        for entry in rows:
            q, k, qw, kw, cache = make_case(entry["tokens"], entry["batch"])
            try:
                t0 = time.perf_counter()
                compiled(q, k, qw, kw, cache, **kw_)
                torch.cuda.synchronize()
                entry["compile_s"] = time.perf_counter() - t0
                entry["compile_us"] = timed(
                    lambda a=(q, k, qw, kw, cache): compiled(*a, **kw_)) * 1e6
            except Exception as exc:  # noqa: BLE001 - report and continue
                entry["compile_error"] = f"{type(exc).__name__}: {exc}"[:300]
            add_rates(entry)
            save("fused+eager+compile (partial)")
            print(f"  compiled {entry['resolution']} B={entry['batch']} {entry['stream']}: "
                  + (f"{entry['compile_us']:.1f} us" if entry.get("compile_us") else
                     entry.get("compile_error", "?")), flush=True)
            del q, k
    save("complete")

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

    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
