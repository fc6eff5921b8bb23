"""``qkrope`` command line: export | check | build | build-plugin | triton-repo | bench | demo.

Each subcommand lives in its own module that defines ``add_parser(subparsers)``; the parser it
registers sets ``func(args) -> int``. Modules keep their heavy imports (diffusers, TensorRT)
inside functions, so ``qkrope --help`` stays fast and works without them.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from qkrope import __version__
from qkrope._deps import MissingDependencyError

# (module, in the order shown by --help)
_SUBCOMMAND_MODULES = (
    "qkrope.export.onnx_export",     # export
    "qkrope.runtime.parity",         # check
    "qkrope.runtime.plugin_build",   # build-plugin
    "qkrope.runtime.engine",         # build
    "qkrope.runtime.triton",         # triton-repo
    "qkrope.runtime.bench",          # bench
    "qkrope.runtime.demo",           # demo (the README's main job)
)


class UserError(Exception):
    """Bad input from the command line: printed as one message, exit status 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="qkrope",
        description="Export diffusion transformers with fused QK-RMSNorm + RoPE (Qwen-Image) to "
                    "ONNX and TensorRT, check parity, and deploy.",
    )
    parser.add_argument("--version", action="version", version=f"qkrope {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _SUBCOMMAND_MODULES:
        importlib.import_module(name).add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (UserError, MissingDependencyError, FileNotFoundError, ValueError, RuntimeError) as exc:
        # Errors raised for bad input carry the fix in their message; no traceback for them.
        print(f"qkrope {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"qkrope {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    raise SystemExit(main())
