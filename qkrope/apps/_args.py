"""The flags several commands take, each declared once (as polygraphy's ``tools/args`` groups):
``--plugin``, ``--engine``, the ``--dtype`` of a model precision and ``--rounding``.

Each ``add_*`` registers its flag on a parser with the command's own sentence for what the flag
does there (its default, what it goes with); the parts every command shares (the metavar, the
choices, the library's file name, the default taken from :mod:`qkrope.contract`) come from here.
The ``check_*`` functions are the matching first checks of a command's ``run``: the path exists and
is what the flag takes, said before torch, onnx or TensorRT is imported.

Only light modules are imported, so ``qkrope CMD --help`` stays as fast as without them.
"""

from __future__ import annotations

import argparse

from qkrope import contract, dtypes
from qkrope.runtime.plugin_build import LIBRARY_FILES

PLUGIN_FILE_NAME = LIBRARY_FILES["plugin"][0]
VC_PLUGIN_FILE_NAME = LIBRARY_FILES["vc"][0]
#: the fix a missing --plugin path is answered with
PLUGIN_FIX = f"build it with `qkrope build-plugin`, or pass the path of {PLUGIN_FILE_NAME}"
#: --dtype values: the model precisions qkrope exports (qkrope.dtypes' short names)
DTYPE_CHOICES = tuple(sorted(dtypes.NAME_BY_SHORT))
#: --rounding values: the node's rounding attribute (docs/spec.md section 4)
ROUNDING_CHOICES = contract.ROUNDING_MODES


def or_list(items) -> str:
    """``a, b or c``: how the help texts list the model families (from qkrope.families)."""
    items = list(items)
    return ", ".join(items[:-1]) + (" or " if len(items) > 1 else "") + items[-1]


def add_plugin(parser, usage: str) -> argparse.Action:
    """``--plugin LIB``; ``usage`` says what the command does without it (its default) or
    what it goes with."""
    return parser.add_argument("--plugin", metavar="LIB", default=None,
                               help=f"the QKNormRoPE plugin library ({PLUGIN_FILE_NAME}); {usage}")


def add_allow_host_code(parser, usage: str = "") -> argparse.Action:
    """``--allow-host-code``: the caller's explicit consent to run the plugin library a
    version-compatible engine carries (refused otherwise; qkrope runs no code a file brings)."""
    from qkrope.runtime.loader_tensorrt import ALLOW_HOST_CODE_HELP

    return parser.add_argument("--allow-host-code", action="store_true",
                               help=f"{usage}{ALLOW_HOST_CODE_HELP}")


def check_plugin(args: argparse.Namespace) -> None:
    from qkrope import _preflight as pre

    pre.input_file(args.plugin, flag="--plugin", fix=PLUGIN_FIX)


def add_engine(parser, usage: str, *, flag: str = "--engine") -> argparse.Action:
    """``--engine MODEL.engine`` (or another engine flag): a TensorRT engine written by
    ``qkrope build``; ``usage`` says what the command does with it."""
    return parser.add_argument(flag, metavar="MODEL.engine", default=None,
                               help=f"a TensorRT engine (written by `qkrope build`): {usage}")


def check_engine(args: argparse.Namespace, command: str, *, flag: str = "--engine") -> None:
    """The engine flag's file, when given, is an engine (an ONNX model there is named as such)."""
    value = getattr(args, flag.lstrip("-").replace("-", "_"))
    if value is not None:
        from qkrope import _preflight as pre

        pre.engine(value, command=f"{command} {flag}", flag=flag, onnx_ok=True)


def add_dtype(parser, usage: str, *, default: str | None) -> argparse.Action:
    """``--dtype {bf16,fp16,fp32}``: a model precision; ``usage`` says what it sets."""
    return parser.add_argument("--dtype", choices=DTYPE_CHOICES, default=default, help=usage)


def add_rounding(parser, usage: str | None = None) -> argparse.Action:
    """``--rounding {0,1,2}`` (:data:`qkrope.contract.ROUNDING_MODES`), default
    :data:`qkrope.contract.DEFAULT_ROUNDING`."""
    default = contract.DEFAULT_ROUNDING
    meaning = usage or "; ".join(f"{m}: {contract.ROUNDING_MEANINGS[m]}"
                                 for m in contract.ROUNDING_MODES)
    return parser.add_argument("--rounding", type=int, choices=ROUNDING_CHOICES, default=default,
                               help=f"the node's rounding attribute, {meaning} (default {default})")
