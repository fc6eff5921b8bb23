#!/usr/bin/env python3
"""Static performance report of the qkrope CUDA kernel.

Compiles plugins/kernel/qknorm_rope.cu for sm_90 (and sm_100) into build/kernel_report/ and
prints, per kernel instance:
  - from ptxas (-Xptxas -v): registers, spill stores/loads, stack frame, static shared memory, and
    the occupancy those imply (from the HARDWARE table of qkrope.apps.kernel_report.assumptions);
  - from the SASS (cuobjdump -sass, which needs nvdisasm): the hot loop (the innermost loop that
    contains the 128-bit q/k stores), the width and qualifiers of every global load/store in it,
    the instruction counts along the common path (prologue, one loop iteration, epilogue; slow-path
    call blocks and the NaN fix-up excluded), the instruction mix, and, from the control bits of
    every instruction (the scoreboard a load sets, the wait mask, DEPBAR.LE), the global bytes
    still outstanding past each wait of the token loop;
and then runs the real launcher (the same source under the SIMT emulation, dry run) against the
modelled devices MODELLED_DEVICES (H100, H200, B200, L40S, A100: SM counts, clocks, bus widths,
occupancy from each instance's ptxas registers) for every launch of every family record
(FamilyRecord.launches: heads, head size, tokens and rounding modes of each model's usual
sizes), and reports for each instance a launch picks: whole-kernel instructions per element (one iteration per token plus the
prologue and epilogue amortised over that launch's tokens per row group) and the global read bytes
outstanding per SM past every wait of the token loop (the fewest at any wait, and the average).

    python scripts/kernel_report.py                      # sm_90 and sm_100, text table
    python scripts/kernel_report.py --arch 90 --json build/kernel_report/report.json
    python scripts/kernel_report.py --cubin some.cubin   # analyse an existing cubin
    python scripts/kernel_report.py --check              # exit 1 when a structural fact fails

--check asserts static facts only (tests/test_kernel_report.py and scripts/gpu_check.sh use it):
128-bit q/k loads and stores in the fast-path hot loop, no spills / local memory on the fast path,
stores with the default cache policy, the reference instances' per-token instructions under
THRESHOLDS (the fast-path instances of the default family's launch shape),
and, for the launched instances on the sm_90 devices, LAUNCH_TARGETS (bytes in flight per SM and
whole-kernel instructions per element). Speed itself is measured by scripts/bench_kernel.py.

The package does the work: qkrope.apps.kernel_report.sass reads the SASS (parser, control flow, loads) and
qkrope.apps.kernel_report makes the report; this script parses the flags and prints it.

Exit status: 0 ok, 1 a --check fact failed, 2 a tool is missing or the build/analysis failed.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from qkrope._fileio import write_text_atomic
from qkrope.apps import kernel_report
from qkrope.runtime import toolchain


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default=None,
                    help="comma-separated SM versions to compile for (default 90,100); with --cubin, "
                         "a filter")
    ap.add_argument("--cubin", action="append", help="analyse this cubin instead of compiling (repeatable)")
    ap.add_argument("--source", default=str(kernel_report.SOURCE), help="the kernel source (default %(default)s)")
    ap.add_argument("--out-dir", default=str(kernel_report.BUILD_DIR), help="build folder (default %(default)s)")
    ap.add_argument("--nvcc", help=f"nvcc to use (default: $CUDACXX, PATH, {toolchain.NVCC_DEFAULT_PATH})")
    ap.add_argument("--cuobjdump", help="cuobjdump to use (default: PATH, CUDA, the PyPI wheel)")
    ap.add_argument("--nvdisasm", help="nvdisasm to use (default: PATH, CUDA, the PyPI wheel)")
    ap.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    ap.add_argument("--details", choices=("none", "reference", "all"), default="reference",
                    help="per-instance detail blocks: the reference instances (the default family's "
                         "launch shape) (default), all, none")
    ap.add_argument("--check", action="store_true", help="exit 1 when a structural fact fails")
    ap.add_argument("--no-launches", action="store_true",
                    help="skip running the real launcher against the modelled devices (it needs the SIMT "
                         "emulation library: " + "cmake -S plugins/kernel -B build/kernel-simt && cmake --build "
                         "build/kernel-simt --target qkrope_kernels_simt)")
    simt = toolchain.LIBRARIES["kernels_simt"]
    ap.add_argument("--simt-lib", help=f"the SIMT emulation library (default: ${simt.env}, then "
                    + ", ".join(str(f.relative_to(toolchain.REPO_ROOT)) for f in simt.folders) + ")")
    args = ap.parse_args(argv)
    args.archs = None
    if args.arch is not None:
        try:
            args.archs = [int(a.strip().removeprefix("sm_")) for a in args.arch.split(",") if a.strip()]
        except ValueError:
            ap.error(f"--arch: expected e.g. 90,100, got {args.arch!r}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        report = kernel_report.build_report(
            args.archs, cubins=args.cubin, nvcc=args.nvcc, cuobjdump=args.cuobjdump, nvdisasm=args.nvdisasm,
            source=Path(args.source), out_dir=Path(args.out_dir), launches=not args.no_launches,
            simt_lib=args.simt_lib)
    except kernel_report.ToolError as e:
        print(f"kernel_report: error: {e}", file=sys.stderr)
        return 2
    print(kernel_report.format_text(report, details=args.details))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(args.json, json.dumps(kernel_report.json_ready(report), indent=1) + "\n")
    if args.check and not report["ok"]:
        bad = sum(not c["ok"] for c in report["checks"])
        print(f"kernel_report: {bad} structural check(s) failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
