#!/usr/bin/env python3
"""Achieved bandwidth of the fused kernel against a 128-bit copy on the same GPU.

For every launch of the kernel report's tables (qkrope.apps.kernel_report.launch_problems: the
Qwen-Image image streams at 512^2, 1024^2, 1328^2 and its 512-token text stream, FLUX's 24/32/48
heads x image 4096 / text 512 / single 4608 tokens; batch 1 and 2; each in its model's first
rounding mode), each kernel library given with --kernel (e.g. the kernel before and after the
cp.async ring, side by side) is timed, and so is a plain 128-bit copy (scripts/copy128.cu) of the
same number of bytes (the launch's reads and writes: q, k in and out, the weights, one fp32
cache row per token: qkrope.apps.measure.qknorm_rope_stream_bytes). Timing: kernel_bench.time_launches (raw C-ABI launches captured in a CUDA graph, rotating
over buffer sets larger than twice the L2, so every launch reads from DRAM). The figure per
kernel is its GB/s and its fraction of the copy's GB/s on this GPU; the kernels' outputs are
compared bit for bit (they compute the same arithmetic in the same order).

    python scripts/bandwidth_check.py --copy-lib build/kernel/libqkrope_copy128.so \\
        --kernel new=build/kernel/libqkrope_kernels.so --kernel old=build/kernel-old/libqkrope_kernels.so \\
        --json build/gpu_check/bandwidth.json [--quick] [--budget-s 120]

scripts/gpu_check.sh builds the libraries and runs it. Exit status: 0 ok, 1 a kernel failed or
the kernels disagree, 2 bad arguments or no GPU.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import sys
import time
from pathlib import Path

from qkrope._fileio import write_text_atomic


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--copy-lib", required=True, help="libqkrope_copy128.so (scripts/copy128.cu)")
    ap.add_argument("--kernel", action="append", required=True, metavar="NAME=LIB",
                    help="a kernel library (libqkrope_kernels.so) and its column name; repeatable")
    ap.add_argument("--json", metavar="PATH", help="write the rows as JSON (rewritten after each row)")
    ap.add_argument("--quick", action="store_true", help="batch 1 only, fewer replays")
    ap.add_argument("--budget-s", type=float, default=300.0,
                    help="stop starting new rows after this many seconds (default %(default)s)")
    args = ap.parse_args(argv)
    kernels = []
    for spec in args.kernel:
        name, sep, lib = spec.partition("=")
        if not sep or not name or not lib:
            ap.error(f"--kernel: expected NAME=LIB, got {spec!r}")
        if not Path(lib).is_file():
            ap.error(f"--kernel {name}: no library at {lib}")
        kernels.append((name, lib))
    if not Path(args.copy_lib).is_file():
        ap.error(f"--copy-lib: no library at {args.copy_lib} (scripts/gpu_check.sh builds it)")
    args.kernels = kernels
    return args


def _load_kernel(lib: str):
    dll = ctypes.CDLL(lib)
    f = dll.qkrope_launch
    f.restype = ctypes.c_int32
    f.argtypes = ([ctypes.c_void_p] * 7 + [ctypes.c_int64] * 6 + [ctypes.c_float]
                  + [ctypes.c_int32] * 3 + [ctypes.c_void_p])
    return f


def _load_copy(lib: str):
    f = ctypes.CDLL(lib).qkrope_copy128
    f.restype = ctypes.c_int32
    f.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p]
    return f


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bandwidth_check: error: no CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    from qkrope.apps import kernel_bench as kb
    from qkrope.apps.kernel_report import launch_problems
    from qkrope.apps.measure import qknorm_rope_stream_bytes
    from qkrope.runtime.kernels import DTYPE_CODES

    dev = torch.device("cuda")
    l2 = kb.l2_bytes(dev)
    copy = _load_copy(args.copy_lib)
    kernels = [(name, _load_kernel(lib)) for name, lib in args.kernels]
    iters, warmup = (5, 2) if args.quick else (20, 3)
    problems = [p for p in launch_problems() if not (args.quick and p["batch"] != 1)]
    rows, status, start = [], 0, time.monotonic()
    print(f"device {torch.cuda.get_device_name(dev)}, L2 {l2 / 2**20:.0f} MiB; kernels: "
          + ", ".join(f"{n}={lib}" for n, lib in args.kernels) + "; copy: " + args.copy_lib)
    for p in problems:
        if time.monotonic() - start > args.budget_s:
            print(f"budget of {args.budget_s:.0f} s spent: {len(problems) - len(rows)} launches not measured")
            break
        # the project's one formula of a launch's DRAM traffic (q, k in and out, weights, cache rows)
        nbytes = qknorm_rope_stream_bytes(p["seq"], p["heads"], p["head_dim"], batch=p["batch"])
        sets = kb.rotation_sets(nbytes, l2)
        launches = kb.graph_launches(20, sets)
        rounding = p["roundings"][0]
        shape = (p["batch"], p["seq"], p["heads"], p["head_dim"])
        gen = torch.Generator(device=dev).manual_seed(0)
        base = [torch.randn(shape, generator=gen, device=dev).to(torch.bfloat16) for _ in range(2)]
        w = (torch.rand(p["head_dim"], generator=gen, device=dev) + 0.5).to(torch.bfloat16)
        ang = torch.rand(p["seq"], p["head_dim"] // 2, generator=gen, device=dev) * 6.0
        cache = torch.cat([ang.cos(), ang.sin()], -1).contiguous()
        bufs = [(base[0].clone(), base[1].clone(), cache.clone(), torch.empty(shape, dtype=torch.bfloat16, device=dev),
                 torch.empty(shape, dtype=torch.bfloat16, device=dev)) for _ in range(sets)]
        n16 = nbytes // 2 // 16
        csrc = [torch.empty(n16 * 16, dtype=torch.uint8, device=dev) for _ in range(sets)]
        cdst = [torch.empty(n16 * 16, dtype=torch.uint8, device=dev) for _ in range(sets)]
        row = {"model": p["model"], "stream": p["stream"], "batch": p["batch"], "tokens": p["tokens"],
               "rounding": rounding, "bytes": nbytes, "sets": sets}

        def copy_step(i):
            rc = copy(csrc[i].data_ptr(), cdst[i].data_ptr(), n16, torch.cuda.current_stream().cuda_stream)
            if rc != 0:
                raise RuntimeError(f"copy128 failed: cudaError {rc}")

        t = kb.time_launches(copy_step, sets=sets, launches=launches, iters=iters, warmup=warmup)
        copy_us = t.summary()["median"] * 1e3
        row["copy"] = {"us": copy_us, "gb_s": nbytes / (copy_us * 1e-6) / 1e9}
        first_out = None
        for name, fn in kernels:
            def step(i, fn=fn):
                q, k, c, qo, ko = bufs[i]
                rc = fn(q.data_ptr(), k.data_ptr(), w.data_ptr(), w.data_ptr(), c.data_ptr(), qo.data_ptr(),
                        ko.data_ptr(), p["batch"], p["seq"], p["heads"], p["head_dim"], p["head_dim"], p["seq"],
                        1e-6, 1, rounding, DTYPE_CODES[torch.bfloat16], torch.cuda.current_stream().cuda_stream)
                if rc != 0:
                    raise RuntimeError(f"{name}: qkrope_launch returned {rc}")

            try:
                t = kb.time_launches(step, sets=sets, launches=launches, iters=iters, warmup=warmup)
            except RuntimeError as exc:
                row[name] = {"error": str(exc)}
                status = 1
                continue
            us = t.summary()["median"] * 1e3
            gbs = nbytes / (us * 1e-6) / 1e9
            row[name] = {"us": us, "gb_s": gbs, "of_copy": gbs / row["copy"]["gb_s"]}
            out = torch.cat([bufs[0][3].flatten(), bufs[0][4].flatten()]).view(torch.int16)
            if first_out is None:
                first_out = out.clone()
            elif not torch.equal(out, first_out):
                row[name]["agrees"] = False
                status = 1
        rows.append(row)
        cols = "  ".join(f"{n} {row[n]['us']:.1f} us {100 * row[n]['of_copy']:.0f} %" if "us" in row[n]
                         else f"{n} FAILED" for n, _ in kernels)
        print(f"{p['model']:<10} {p['stream']:<16} b{p['batch']}  {nbytes / 1e6:7.1f} MB  copy "
              f"{copy_us:7.1f} us {row['copy']['gb_s']:6.0f} GB/s  {cols}", flush=True)
        if args.json:
            write_text_atomic(args.json, json.dumps({"rows": rows}, indent=1) + "\n")
        del bufs, csrc, cdst
        torch.cuda.empty_cache()
    names = [n for n, _ in kernels]
    print("\n| model | launch | batch | MB | copy GB/s | " + " | ".join(f"{n} µs (% of copy)" for n in names) + " |")
    print("|---|---|---|---|---|" + "---|" * len(names))
    for r in rows:
        cells = " | ".join(f"{r[n]['us']:.1f} ({100 * r[n]['of_copy']:.0f} %)" if "us" in r[n] else "failed"
                           for n in names)
        print(f"| {r['model']} | {r['stream']} | {r['batch']} | {r['bytes'] / 1e6:.1f} | "
              f"{r['copy']['gb_s']:.0f} | {cells} |")
    disagree = [f"{r['model']} {r['stream']} b{r['batch']}" for r in rows
                if any(r[n].get("agrees") is False for n in names)]
    if disagree:
        print(f"bandwidth_check: the kernels' outputs differ on: {', '.join(disagree)}", file=sys.stderr)
    return status


if __name__ == "__main__":
    sys.exit(main())
