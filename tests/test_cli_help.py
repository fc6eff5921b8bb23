"""`qkrope --help` and every `qkrope CMD --help` import neither torch, onnx, onnxscript nor
onnxruntime (issue 11): the CLI imports a subcommand's module only when that subcommand is parsed,
and the modules keep those imports inside their command functions."""

import json
import subprocess
import sys

import pytest

from qkrope import cli

HEAVY = ("torch", "onnx", "onnxscript", "onnxruntime")
COMMANDS = [name for name, _, _ in cli._SUBCOMMANDS]

# Modules owned elsewhere that still import qkrope.runtime (hence torch) at module level; each
# entry says which import does it. Remove an entry when that module imports lazily.
KNOWN_HEAVY: dict[str, str] = {}  # every subcommand's --help is light

_CODE = """
import contextlib, io, json, sys, time
t = time.perf_counter()
from qkrope.cli import main
heavy = {heavy!r}
result = {{}}
for argv in {argvs!r}:
    before = {{m for m in heavy if m in sys.modules}}
    with contextlib.redirect_stdout(io.StringIO()):
        try:
            main(argv + ["--help"])
        except SystemExit as exc:
            assert exc.code == 0, (argv, exc.code)
    result[" ".join(argv) or "qkrope"] = sorted(m for m in heavy if m in sys.modules and m not in before)
print(json.dumps({{"imported": result, "all": sorted(m for m in heavy if m in sys.modules),
                  "seconds": time.perf_counter() - t}}))
"""


def _help_run(argvs):
    code = _CODE.format(heavy=HEAVY, argvs=argvs)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_top_level_and_light_subcommand_help_import_nothing_heavy():
    light = [[]] + [[c] for c in COMMANDS if c not in KNOWN_HEAVY]
    got = _help_run(light)
    print(f"--help of qkrope and {len(light) - 1} subcommands: {got['seconds']:.3f} s")
    offenders = {k: v for k, v in got["imported"].items() if v}
    assert not offenders, f"--help imported heavy modules: {offenders}"
    assert got["all"] == []


@pytest.mark.parametrize("command", COMMANDS)
def test_each_subcommand_help_alone(command):
    got = _help_run([[command]])
    imported = got["all"]
    if command in KNOWN_HEAVY:
        if imported:
            pytest.xfail(f"`qkrope {command} --help` imports {imported}: {KNOWN_HEAVY[command]}")
        pytest.fail(f"`qkrope {command} --help` is light now: remove it from KNOWN_HEAVY")
    assert imported == [], f"`qkrope {command} --help` imported {imported}"


def test_lazy_parser_still_parses_and_dispatches():
    parser = cli.build_parser()
    args = parser.parse_args(["export", "--model", "transformer", "--diffusers", "D"])
    from qkrope.apps import export

    assert args.func is export.run and args.diffusers == "D" and args.command == "export"
    full = cli.build_parser(load_all=True)
    (subparsers,) = [a for a in full._actions if a.dest == "command"]
    assert "--diffusers" in subparsers.choices["export"].format_help()
    assert "--engine" in subparsers.choices["check"].format_help()
