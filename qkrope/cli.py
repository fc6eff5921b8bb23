"""``qkrope`` command line: export | check | build | build-plugin | triton-repo | bench | demo.

Each subcommand lives in its own module of :mod:`qkrope.apps` that defines
``add_parser(subparsers)``; the parser it
registers sets ``func(args) -> int``. Modules keep their heavy imports (diffusers, TensorRT)
inside functions, so ``qkrope --help`` stays fast and works without them.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from qkrope import __version__
from qkrope.errors import QkropeError

# (module, in the order shown by --help)
_SUBCOMMAND_MODULES = (
    "qkrope.apps.export",            # export
    "qkrope.apps.check",             # check
    "qkrope.apps.build_plugin",      # build-plugin
    "qkrope.apps.build",             # build
    "qkrope.apps.triton_repo",       # triton-repo
    "qkrope.apps.bench",             # bench
    "qkrope.apps.demo",              # demo (the README's main job)
)


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
    """Run the CLI. Errors raised for bad input print one line (they carry what was received and
    the fix) and exit 2; other failures keep their traceback (exit 1). QKROPE_DEBUG=1 shows the
    traceback for every error."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        print(f"qkrope {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - sorted into user errors and failures below
        # The class decides: qkrope's own errors (QkropeError) are user errors whose message
        # carries the fix; anything else is a bug or a dependency's failure (traceback).
        if os.environ.get("QKROPE_DEBUG") or not isinstance(exc, QkropeError):
            raise
        print(f"qkrope {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
