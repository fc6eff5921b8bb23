"""`qkrope --help` and every `qkrope CMD --help` import neither torch, onnx, onnxscript nor
onnxruntime: the CLI imports a subcommand's module only when that subcommand is parsed,
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


# ---- one home per constant: the commands restate none of their sources' values ----------------

SHARED_FLAGS = ("--plugin", "--engine", "--dtype", "--rounding")  # declared in qkrope/apps/_args.py


def _source_values():
    from qkrope import dtypes, quantization, sidecars
    from qkrope.runtime.plugin_build import LIBRARY_FILES

    names = [name for name, _ in LIBRARY_FILES.values() if name.endswith(".so")]
    tuples = [sidecars.LEVELS, tuple(dtypes.NAME_BY_SHORT), tuple(dtypes.SHORT_BY_NAME),
              quantization.DEFAULT_EXCLUDED, quantization.QUANT_MODES]
    return names, [frozenset(t) for t in tuples], {line for _, _, line in cli._SUBCOMMANDS}


def _copies(path, names, tuples, help_lines) -> list[str]:
    """Literals in one command module that restate a source's value: a native library's file
    name, a tuple of levels / dtype names / quant modes / --exclude's default, a command's help
    line (cli._SUBCOMMANDS holds them), or a shared flag declared outside the helper."""
    import ast

    tree = ast.parse(path.read_text())
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.FunctionDef, ast.ClassDef)) and n.body
                  and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and id(node) not in docstrings:
            found += [f"{name!r} in {node.value!r}" for name in names if name in node.value]
            if node.value in help_lines:
                found.append(f"help line {node.value!r}")
        elif isinstance(node, (ast.Tuple, ast.List)) and node.elts and all(
                isinstance(e, ast.Constant) for e in node.elts):
            if frozenset(e.value for e in node.elts) in tuples:
                found.append(f"tuple {[e.value for e in node.elts]}")
        elif isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument" \
                and node.args and isinstance(node.args[0], ast.Constant) \
                and node.args[0].value in SHARED_FLAGS and path.name != "_args.py":
            found.append(f"add_argument({node.args[0].value!r}) (use qkrope.apps._args)")
    return [f"{path.name}:{line}" for line in found]


def test_commands_restate_no_constant_of_their_sources():
    """The apps (and the scripts over them) import their constants from the module that defines
    them and declare the shared flags through qkrope.apps._args."""
    from pathlib import Path

    root = Path(cli.__file__).resolve().parent
    paths = [*sorted((root / "apps").rglob("*.py")), root.parent / "scripts" / "bench_kernel.py"]
    found = [c for p in paths for c in _copies(p, *_source_values())]
    assert found == []
