"""One error base class: every error qkrope raises on purpose is a QkropeError, and the CLI's
"user error or bug" decision reads the class (not where the traceback ends)."""

from __future__ import annotations

import argparse
import importlib
import inspect
import pkgutil
import re

import pytest

import qkrope
from qkrope import cli
from qkrope.errors import InputError, InputFileNotFoundError, QkropeError

# Control-flow signals that never leave their module (not errors).
# Not qkrope's user errors: demo's step-skip signal, and the errors of the code that runs inside
# Triton's Python backend without qkrope (the position schemes, copied beside the rope model, and
# the rope model itself): qkrope.runtime.caches turns the overflow into RopeCacheOverflowError and
# the other refusals into an InputError, the rope model answers them as TritonError(INVALID_ARG).
_INTERNAL = {"qkrope.apps.demo.Skip", "qkrope.runtime.schemes._common.BadRequest",
             "qkrope.runtime.schemes._common.PositionOverflow",
             "qkrope.runtime.schemes._common.BadPositions",
             "qkrope.runtime.schemes._common.TooLarge",
             "qkrope.runtime.triton_rope_model.RequestError",
             # control flow inside the drop-in's save (re-raised as its own error, never shown)
             "qkrope.runtime.component._Refused"}


def _modules():
    import qkrope.export
    import qkrope.runtime

    names = set()
    for pkg in (qkrope, qkrope.export, qkrope.runtime):  # export/, runtime/ live apart on disk
        names.add(pkg.__name__)
        names.update(i.name for i in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."))
    for name in sorted(names - {"qkrope.__main__"}):
        yield importlib.import_module(name)


def test_every_project_error_derives_from_qkrope_error():
    found = []
    for mod in _modules():
        for name, obj in vars(mod).items():
            if (inspect.isclass(obj) and issubclass(obj, BaseException)
                    and obj.__module__ == mod.__name__
                    and f"{mod.__name__}.{name}" not in _INTERNAL):
                found.append(obj)
                assert issubclass(obj, QkropeError), f"{mod.__name__}.{name}"
    names = {c.__name__ for c in found}
    for expected in ("RopeCacheError", "RunnerError", "EngineBuildError", "ExportError",
                     "MissingDependencyError", "ProfileError", "TritonRepoError"):
        assert expected in names
    assert issubclass(InputError, ValueError) and issubclass(InputFileNotFoundError,
                                                             FileNotFoundError)


def _cli_with(monkeypatch, exc):
    def raising_parser():
        p = argparse.ArgumentParser(prog="qkrope")
        sub = p.add_subparsers(dest="command")
        sub.add_parser("boom").set_defaults(func=lambda args: (_ for _ in ()).throw(exc))
        return p

    monkeypatch.setattr(cli, "build_parser", raising_parser)
    monkeypatch.delenv("QKROPE_DEBUG", raising=False)
    return cli.main(["boom"])


def test_cli_user_error_is_one_line_exit_2(monkeypatch, capsys):
    assert _cli_with(monkeypatch, InputError("bad --thing 3; Fix: use 4")) == 2
    err = capsys.readouterr().err
    assert err == "qkrope boom: error: bad --thing 3; Fix: use 4\n"


def test_cli_other_exceptions_keep_their_traceback(monkeypatch):
    # a ValueError that is not a QkropeError is a bug, wherever it was raised
    with pytest.raises(ValueError, match="internal"):
        _cli_with(monkeypatch, ValueError("internal"))
    with pytest.raises(KeyError):
        _cli_with(monkeypatch, KeyError("x"))


@pytest.mark.parametrize("args, match", [
    # check and build take a pipeline export folder too: another folder is named as neither
    (["check", "."], r"\. is a folder but no pipeline export .*or one MODEL\.onnx"),
    (["build", ".", "-o", "x.engine"], r"is a folder but no pipeline export .*or one MODEL\.onnx"),
    (["refit", ".", "--state-dict", "w.pt"], r"is a folder, not a file"),
    (["triton-repo", "--engine", ".", "-o", "repo"], r"is a folder, not a file"),
    (["export", "--heads", "99999999999999999999", "--out", "x.onnx"],
     r"needs .* GiB, more than this machine's .* Fix: give smaller --heads / --head-dim"),
    (["export", "--batch", "99999999999999", "--out", "x.onnx"],
     r"the export sample .* Fix: give smaller --batch"),
    (["export", "--img-shape", "1", "99999999999", "4", "--out", "x.onnx"], r"export sample"),
    (["export", "--heads", "2", "--head-dim", "16", "--seed", "99999999999999999999999",
      "--out", "x.onnx"], r"--seed must be an integer in"),
])
def test_junk_arguments_are_one_line(tmp_path, monkeypatch, capsys, args, match):
    """A folder where a file goes (its name has no suffix to suggest a fix with), and sizes or
    a seed that torch would overflow on (RuntimeError, ValueError, a crash): one line, exit 2,
    nothing written."""
    from qkrope.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert re.search(match, err) and err.count("\n") == 1 and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == []
