"""``qkrope build-plugin``: argument handling over :func:`qkrope.runtime.plugin_build.build_plugins`."""

from __future__ import annotations

import argparse

from qkrope.runtime import plugin_build


def _run(args: argparse.Namespace) -> int:
    from qkrope import _preflight as pre  # before torch: a wrong path answers at once

    pre.input_dir(args.tensorrt_root, flag="--tensorrt-root",
                  fix="pass the TensorRT install prefix (the folder holding include/NvInfer.h), "
                      "or leave it out for the pinned headers")
    if args.jobs is not None and args.jobs < 1:
        from qkrope.errors import InputError

        raise InputError(f"--jobs must be >= 1; got {args.jobs}. Fix: --jobs 2")
    out = plugin_build.build_plugins(host_only=args.host_only, arch=args.arch, tensorrt_root=args.tensorrt_root,
                        build_dir=args.build_dir, jobs=args.jobs, clean=args.clean)
    kinds = ("kernel_host",) if args.host_only else ("plugin", "vc", "kernels", "kernel_host")
    print("qkrope build-plugin: built")
    for kind in kinds:
        try:
            print(f"  {kind:12s} {plugin_build.find_plugin_library(kind, build_dir=out)}")
        except plugin_build.PluginNotBuiltError:
            print(f"  {kind:12s} (not built: no TensorRT headers?)" if kind in ("plugin", "vc") else
                  f"  {kind:12s} (not built)")
    return 0


def add_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``qkrope build-plugin`` on an argparse subparsers object."""
    lib = {kind: name for kind, (name, _) in plugin_build.LIBRARY_FILES.items()}
    p = subparsers.add_parser(
        "build-plugin",
        description=f"Build {lib['plugin']} (self-registering), {lib['vc']} "
                    f"(version-compatible: getCreators/setLoggerFinder), {lib['kernels']} and "
                    f"{lib['kernel_host']} into build/plugins. TensorRT headers come from "
                    "--tensorrt-root / TensorRT_ROOT / the standard install paths, else the pinned "
                    "kernel-lens 2.0.1 wheel (no TensorRT library is needed to build).",
    )
    p.add_argument("--host-only", action="store_true",
                   help="build only the CPU kernel library (no CUDA, no TensorRT)")
    p.add_argument("--arch", metavar="LIST",
                   help='CUDA architectures: "all" (the deployable fat binary: SASS 80;86;89;90;100 + '
                        'PTX), or a list such as "90" or "80,90,100"; default: this machine\'s GPU '
                        '(native), or PTX for sm_80 only where no GPU is visible')
    p.add_argument("--tensorrt-root", metavar="DIR", help="TensorRT install prefix (DIR/include)")
    p.add_argument("--build-dir", metavar="DIR", default=None, help=f"default: {plugin_build.DEFAULT_BUILD_DIR}")
    p.add_argument("--jobs", "-j", type=int, default=None, help="parallel build jobs (default 2)")
    p.add_argument("--clean", action="store_true", help="remove the build directory first")
    p.set_defaults(func=_run)
    return p

