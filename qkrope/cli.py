"""``qkrope`` command line: export | quantize | check | build | build-plugin | triton-repo | generate |
bench | demo.

Each subcommand lives in its own module of :mod:`qkrope.apps` that defines
``add_parser(subparsers)``; the parser it
registers sets ``func(args) -> int``. Modules keep their heavy imports (torch, onnx, diffusers, TensorRT)
inside functions, and a subcommand's module is imported only when that subcommand is parsed, so
``qkrope --help`` and ``qkrope CMD --help`` stay fast and work without them.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from qkrope import __version__
from qkrope.errors import QkropeError

# (command, module, one-line help shown by `qkrope --help`), in the order shown by --help: the
# one home of the help lines, so that `qkrope --help` imports no command module (each module's
# add_parser gives its parser's description and arguments, not this line).
_SUBCOMMANDS = (
    ("export", "qkrope.apps.export",
     "export the Qwen-Image attention block or a diffusers transformer to ONNX"),
    ("quantize", "qkrope.apps.quantize",
     "calibrate a diffusers transformer to FP8 with NVIDIA ModelOpt (for export --quant fp8)"),
    ("check", "qkrope.apps.check",
     "parity of an exported model (ONNX Runtime, TensorRT) with PyTorch"),
    ("build-plugin", "qkrope.apps.build_plugin",
     "build the CUDA kernel and the TensorRT plugin libraries (CMake, nvcc)"),
    ("build", "qkrope.apps.build", "build a TensorRT engine with the QKNormRoPE plugin"),
    ("refit", "qkrope.apps.refit", "replace an engine's weights by diffusers parameter name"),
    ("triton-repo", "qkrope.apps.triton_repo",
     "write a Triton Inference Server model repository for an engine"),
    ("generate", "qkrope.apps.generate",
     "run a saved diffusers pipeline from a prompt to an image or video, the transformer on an "
     "export or engine, with per-stage timings"),
    ("bench", "qkrope.apps.bench",
     "benchmark the attention block (TensorRT plugin vs no plugin vs torch) and the kernel's "
     "bandwidth"),
    ("demo", "qkrope.apps.demo",
     "the main job: export, check, build the plugin (and engine where possible)"),
)
_SUBCOMMAND_MODULES = tuple(module for _, module, _ in _SUBCOMMANDS)


class _Into:
    """Stands in for the subparsers object handed to a module's ``add_parser``: the parser it
    asks for is the lazy parser already registered under that name."""

    def __init__(self, parser: "_LazyCommandParser"):
        self._parser = parser

    def add_parser(self, name, **kwargs):
        kwargs.pop("help", None)
        kwargs.pop("aliases", None)
        for key in ("description", "epilog", "formatter_class", "usage"):
            if key in kwargs:
                setattr(self._parser, key, kwargs.pop(key))
        return self._parser


class _LazyCommandParser(argparse.ArgumentParser):
    """A subcommand's parser whose arguments are added by its module only when that subcommand is
    parsed or its help is shown, so `qkrope --help` and `qkrope CMD --help` import only CMD's
    module (whose heavy imports, torch among them, are inside its command function)."""

    def __init__(self, *args, module: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._module = module

    def load(self) -> "_LazyCommandParser":
        if self._module is not None:
            module, self._module = self._module, None
            importlib.import_module(module).add_parser(_Into(self))
        return self

    def parse_known_args(self, args=None, namespace=None):
        self.load()
        return super().parse_known_args(args, namespace)

    def format_help(self):
        self.load()
        return super().format_help()

    def format_usage(self):
        self.load()
        return super().format_usage()


def build_parser(*, load_all: bool = False) -> argparse.ArgumentParser:
    """The ``qkrope`` parser. A subcommand's module is imported when that subcommand is parsed
    (or at once for every subcommand with ``load_all=True``)."""
    from qkrope import families  # the records only (no torch)

    parser = argparse.ArgumentParser(
        prog="qkrope",
        description=f"Export diffusion transformers with fused QK-RMSNorm + RoPE "
                    f"({', '.join(r.short for r in families.records())}) to ONNX and "
                    f"TensorRT, check parity, and deploy.",
    )
    parser.add_argument("--version", action="version", version=f"qkrope {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND",
                                parser_class=_LazyCommandParser)
    for name, module, help_line in _SUBCOMMANDS:
        command = sub.add_parser(name, help=help_line, module=module)
        if load_all:
            command.load()
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
