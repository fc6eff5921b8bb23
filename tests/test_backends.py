"""qkrope.runtime.load (qkrope.runtime.backends): the suffix picks the backend, files that are
not what their suffix says are refused before TensorRT, a missing TensorRT is one message."""

from __future__ import annotations

import pytest

import sys
from pathlib import Path

from _runner_helpers import exported  # noqa: F401

from qkrope._deps import MissingDependencyError
from qkrope.runtime import runner as rn
from qkrope.runtime.backends import load


# --------------------------------------------------------------------------------------------
# load(): suffixes, missing TensorRT
# --------------------------------------------------------------------------------------------

def test_load_dispatch_errors(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError):
        load(tmp_path / "nope.onnx")
    odd = tmp_path / "model.bin"
    odd.write_bytes(b"x")
    with pytest.raises(rn.RunnerError, match=r"\.engine or \.plan"):
        load(odd)
    eng_file = tmp_path / "model.engine"
    eng_file.write_bytes(b"not an engine")
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    with pytest.raises(MissingDependencyError, match="NGC TensorRT container"):
        load(eng_file)


def test_load_is_exported_from_runtime():
    import qkrope.runtime as rt

    assert rt.load is load
    assert rt.RunnerInputError is rn.RunnerInputError


@pytest.mark.parametrize("content", ["onnx", "empty"])
def test_load_of_an_engine_that_is_not_one_is_refused_before_tensorrt(exported, tmp_path,
                                                                      monkeypatch, content):
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    fake = tmp_path / "m.engine"
    fake.write_bytes(Path(exported[0]).read_bytes() if content == "onnx" else b"")
    with pytest.raises(rn.RunnerError, match="not a TensorRT engine"):
        load(fake)

