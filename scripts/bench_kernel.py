#!/usr/bin/env python
"""Bandwidth of the fused QKNormRoPE CUDA kernel at Qwen-Image shapes, vs torch eager and torch.compile.

Rows: 512x512 (1024 image tokens) and 1024x1024 (4096 image tokens), 512 text tokens, batch 1
and 2, 24 heads x 128, bf16 q/k/weights, fp32 cos|sin cache; per stream (img, txt) and per block
(block = the img and the txt launch a transformer block makes). Backends:
  fused     libqkrope_kernels.so's C ABI qkrope_launch, called directly through ctypes
  eager     qkrope.export.qk_norm_rope_reference in eager PyTorch
  compile   torch.compile of the same reference (static shapes, default mode)

Method (qkrope.apps.kernel_bench, the one used by `qkrope bench`'s kernel rows too): buffer
sets rotated so that together they exceed 2 x L2 (every launch reads DRAM); the fused launch is
validated once through qkrope.runtime.kernels.cuda_qk_norm_rope and spot-checked against an fp32
reference; N launches over the sets are captured in a CUDA graph, replays timed with CUDA events,
per-launch time = elapsed / N, median and p10/p90 over the replays. Bytes = q, k read + q_out,
k_out written + both weights + the cache rows; % of peak against the GPU's data-sheet bandwidth.
The JSON is rewritten (atomically) after every row; fused and eager rows come first,
torch.compile (slow to compile) last. Exit status: 0, 1 if a fused row failed, 2 without CUDA
or without libqkrope_kernels.so.

    python scripts/bench_kernel.py [--quick] [--shapes 512:1,1024] [--no-compile] [--json F]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NO_CUDA = ("bench_kernel: no CUDA device visible to PyTorch (torch.cuda.is_available() is False"
           "{why}); run this on a machine with an NVIDIA GPU and a CUDA build of PyTorch.")
QUICK = {"shapes": "1024:1", "iters": 5, "warmup": 2, "launches": 8}
DEFAULTS = {"shapes": "512,1024", "iters": 30, "warmup": 5, "launches": 20}


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"512:1,1024"`` -> [(512, 1), (1024, 1), (1024, 2)]: resolution (``512`` or ``512x512``)
    with an optional ``:batch``; without one, batches 1 and 2."""
    from qkrope.apps.measure import image_tokens
    from qkrope.apps.kernel_bench import BATCHES

    out: list[tuple[int, int]] = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        res_s, _, batch_s = item.partition(":")
        side, _, other = res_s.lower().partition("x")
        try:
            res = int(side)
            if other and int(other) != res:
                raise ValueError("only square images")
            batches = [int(batch_s)] if batch_s else list(BATCHES)
            image_tokens(res)
        except ValueError as exc:
            raise ValueError(f"--shapes: bad entry {item!r} ({exc}); expected e.g. "
                             f"512,1024:2 or 1024x1024:1") from None
        if any(b < 1 for b in batches):
            raise ValueError(f"--shapes: batch must be >= 1 in {item!r}")
        out += [(res, b) for b in batches if (res, b) not in out]
    if not out:
        raise ValueError(f"--shapes: no shape in {text!r}")
    return out


def build_parser() -> argparse.ArgumentParser:
    from qkrope.apps import _args

    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        epilog="Method and rows: see the top of scripts/bench_kernel.py and "
               "qkrope/apps/kernel_bench.py.")
    ap.add_argument("--iters", type=int, default=None,
                    help=f"timed graph replays per row (default {DEFAULTS['iters']}, "
                         f"--quick {QUICK['iters']})")
    ap.add_argument("--warmup", type=int, default=None,
                    help=f"warm-up replays (default {DEFAULTS['warmup']}, --quick "
                         f"{QUICK['warmup']})")
    ap.add_argument("--launches-per-graph", dest="launches", type=int, default=None,
                    help=f"launches captured per CUDA graph, rounded up to a multiple of the "
                         f"buffer sets (default {DEFAULTS['launches']}, --quick "
                         f"{QUICK['launches']})")
    ap.add_argument("--shapes", default=None,
                    help=f"resolutions[:batch], comma-separated (default {DEFAULTS['shapes']}: "
                         f"each with batch 1 and 2; --quick {QUICK['shapes']})")
    ap.add_argument("--streams", default="img,txt,block",
                    help="streams to measure: img, txt, block (= img + txt launches of one "
                         "block); default all three")
    ap.add_argument("--json", type=Path, default=None,
                    help="results file, rewritten after every row (default "
                         "$OUT/bench_kernel.json, else build/bench_kernel.json)")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile rows")
    _args.add_rounding(ap, "0: one rounding at the end; 1: diffusers' bf16 intermediate "
                           "rounding (Qwen-Image); 2: FLUX's (torch's RMSNorm, then the fp32 "
                           "rotation)")
    ap.add_argument("--peak-gbs", type=float, default=None,
                    help="peak memory bandwidth in GB/s (default: data-sheet table by GPU name, "
                         "H200 4800)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="soft time limit: rows not started by then are recorded as skipped "
                         "and the table is still printed")
    ap.add_argument("--quick", action="store_true",
                    help="one shape (1024x1024, batch 1), few iterations: a rerun check")
    return ap


def parse_args(argv=None) -> argparse.Namespace:
    ap = build_parser()
    args = ap.parse_args(argv)
    base = QUICK if args.quick else DEFAULTS
    for key, val in base.items():
        if getattr(args, key) is None:
            setattr(args, key, val)
    try:
        args.shape_list = parse_shapes(args.shapes)
        args.stream_list = _parse_streams(args.streams)
    except ValueError as exc:
        ap.error(str(exc))
    for name in ("iters", "launches"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('launches', 'launches-per-graph')} must be >= 1")
    if args.warmup < 0:
        ap.error("--warmup must be >= 0")
    if args.json is None:
        base_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else REPO / "build"
        args.json = base_dir / "bench_kernel.json"
    return args


def _parse_streams(text: str) -> list[str]:
    from qkrope.apps.kernel_bench import STREAMS

    vals = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in vals if s not in STREAMS]
    if bad or not vals:
        raise ValueError(f"--streams: expected a subset of {','.join(STREAMS)}; got {text!r}")
    return [s for s in STREAMS if s in vals]


def _line(row: dict) -> str:
    head = f"  {row['resolution']}x{row['resolution']} B={row['batch']} {row['stream']:<5} " \
           f"{row['backend']:<7}"
    if row["status"] != "ok":
        return f"{head} {row['status']}: {row['reason']}"
    pct = "" if row["pct_peak"] is None else f" = {row['pct_peak']:.1f}% of peak"
    extra = f", compiled+checked in {row['compile_s']} s" if "compile_s" in row else ""
    return (f"{head} {row['median_us']:8.1f} us (p10 {row['p10_us']:.1f}, p90 "
            f"{row['p90_us']:.1f}), {row['gbs']:.0f} GB/s{pct}; K={row['sets']} sets x "
            f"{row['bytes'] / 1e6:.1f} MB, {row['launches_per_graph']} launches/graph"
            f"{'' if row.get('graph') else ' (NO graph)'}, max rel err "
            f"{row['max_rel_err']:.2g}{extra}")


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        why = "" if torch.version.cuda else f"; torch {torch.__version__} is a CPU-only build"
        print(NO_CUDA.format(why=why), file=sys.stderr)
        return 2

    from qkrope.apps import measure
    from qkrope.apps import kernel_bench as kb
    from qkrope.runtime import kernels

    if kernels.cuda_library_path() is None:
        print(f"bench_kernel: {kernels.CUDA_LIB_NAME} not found; build it with: "
              f"{kernels.CUDA_BUILD_COMMAND} (or set {kernels.CUDA_LIB_ENV})", file=sys.stderr)
        return 2

    t_start = time.monotonic()
    device = torch.device("cuda", torch.cuda.current_device())
    machine = measure.machine_info(str(device))
    peak, peak_src = kb.device_peak(device, args.peak_gbs)
    l2 = kb.l2_bytes(device)
    opts = kb.Options(iters=args.iters, warmup=args.warmup, launches=args.launches,
                      rounding=args.rounding)
    cases = [kb.Case(res, batch, stream) for res, batch in args.shape_list
             for stream in args.stream_list]
    machine_line = (f"GPU {machine.get('gpu')}, {machine.get('sm_count')} SMs, L2 "
                    f"{l2 / 2**20:g} MiB, CC {machine.get('compute_capability')}, clocks "
                    f"{machine.get('clocks_mhz', 'n/a')} MHz, driver {machine.get('driver', '?')}, "
                    f"CUDA {torch.version.cuda}, torch {torch.__version__}, python "
                    f"{machine.get('python')}")
    peak_line = (f"peak {peak:.0f} GB/s ({peak_src})" if peak else f"peak {peak_src}")
    config_line = (f"bf16, {kb.HEADS} heads x {kb.HEAD_DIM}, fp32 cache, rounding="
                   f"{args.rounding}; {args.iters} timed replays after {args.warmup} warm-up, "
                   f">= {args.launches} launches per CUDA graph, buffer sets > "
                   f"{opts.l2_factor:g} x L2")
    print(machine_line, flush=True)
    print(peak_line + "; " + config_line, flush=True)
    rec = kb.Recorder(args.json, meta={
        "machine": machine, "machine_line": machine_line, "peak_gbs": peak,
        "peak_source": peak_src, "l2_bytes": l2, "iters": args.iters, "warmup": args.warmup,
        "launches_per_graph": args.launches, "rounding": args.rounding,
        "method": kb.__doc__.split("Method", 1)[1].strip() if kb.__doc__ else ""})
    rec.save("starting")

    def over_budget() -> bool:
        return args.budget_s is not None and time.monotonic() - t_start > args.budget_s

    def run(case, backend, compiled=None):
        if over_budget():
            row = kb.result_row(case, backend, status="skipped",
                                reason=f"--budget-s {args.budget_s:g} s spent")
        else:
            row = kb.measure(case, backend, opts, device=device, peak=peak, l2=l2,
                             compiled=compiled)
        rec.add(row, phase=f"{backend} rows")
        print(_line(row), flush=True)
        return row

    torch.set_grad_enabled(False)
    print("phase 1: fused and eager", flush=True)
    for case in cases:
        for backend in ("fused", "eager"):
            run(case, backend)
    if args.no_compile:
        print("phase 2: torch.compile skipped (--no-compile)", flush=True)
    else:
        print("phase 2: torch.compile (compiled per shape before its graph is captured)",
              flush=True)
        try:
            compiled = kb.make_compiled()
            err = None
        except Exception as exc:  # noqa: BLE001 - every compile row says why
            compiled, err = None, f"torch.compile unavailable: {type(exc).__name__}: {exc}"
        for case in cases:
            if err:
                row = kb.result_row(case, "compile", status="failed", reason=err[:400])
                rec.add(row, phase="compile rows")
                print(_line(row), flush=True)
            else:
                run(case, "compile", compiled)

    table = kb.format_markdown(rec.rows, peak=peak, header=[
        f"## qkrope kernel benchmark ({time.strftime('%Y-%m-%d %H:%M')})", "", machine_line, "",
        peak_line + "; " + config_line + "; times per launch unit (block: img + txt launch)",
        ""])
    rec.meta["markdown"] = table
    rec.save("complete")
    print()
    print(table)
    print(f"\nwrote {args.json} ({len(rec.rows)} rows, {time.monotonic() - t_start:.0f} s)")
    fused_failed = [r for r in rec.rows if r["backend"] == "fused" and r["status"] == "failed"]
    return 1 if fused_failed else 0


if __name__ == "__main__":
    sys.exit(main())
