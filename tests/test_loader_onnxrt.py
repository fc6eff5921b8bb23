"""The ONNX Runtime loader (qkrope.runtime.loader_onnxrt): the node contract, unreadable files
and bad sidecars refused before ONNX Runtime sees the model; ONNX Runtime's own refusals as one
line with the fix."""

from __future__ import annotations

import pytest

import json
from pathlib import Path

from _runner_helpers import IMG_SHAPES, _write_bf16_identity_model, exported, inputs  # noqa: F401

from qkrope.runtime import runner as rn
from qkrope.runtime.backends import load


# --------------------------------------------------------------------------------------------
# The node contract and unreadable files, before ONNX Runtime sees the model
# --------------------------------------------------------------------------------------------

from _bad_nodes import BAD_NODE_CASES, BROKEN_FILES, write_bad_copy  # noqa: E402
from _bad_nodes import write_broken_copy  # noqa: E402


def _no_session(monkeypatch):
    import onnxruntime as ort

    def refuse(*a, **k):
        raise AssertionError("ONNX Runtime opened the model before the qkrope checks")

    monkeypatch.setattr(ort, "InferenceSession", refuse)


@pytest.mark.parametrize("case", list(BAD_NODE_CASES))
def test_load_refuses_nodes_that_break_the_contract(exported, tmp_path, monkeypatch, case):
    from qkrope.errors import QkropeError

    bad, attribute, node = write_bad_copy(exported[0], tmp_path / "bad.onnx", case)
    _no_session(monkeypatch)
    with pytest.raises(QkropeError, match=attribute) as info:
        load(bad)
    assert node in str(info.value)


@pytest.mark.parametrize("case", list(BROKEN_FILES))
def test_load_refuses_unreadable_onnx_files_clearly(exported, tmp_path, monkeypatch, case):
    from qkrope.errors import QkropeError

    bad = write_broken_copy(exported[0], tmp_path / "broken.onnx", case)
    _no_session(monkeypatch)
    with pytest.raises(QkropeError, match=r"not a readable ONNX model.*qkrope export"):
        load(bad)


@pytest.mark.parametrize("edit,field", [
    (lambda d: d.update(inputs=5), "inputs"),
    (lambda d: d.update(config=[1, 2]), "config"),
    (lambda d: d["config"].update(head_dim="sixteen"), "head_dim"),
    (lambda d: d["config"].update(axes_dims_rope="abc"), "axes_dims_rope"),
])
def test_load_wrong_shape_sidecar_is_a_sidecar_error(exported, tmp_path, edit, field):
    import shutil

    from qkrope.sidecars import SidecarError

    path = tmp_path / "m.onnx"
    shutil.copy(exported[0], path)
    data = json.loads(Path(str(exported[0]) + ".json").read_text())
    edit(data)
    Path(str(path) + ".json").write_text(json.dumps(data))
    with pytest.raises(SidecarError, match=field):
        r = load(path)
        r.run_positions(*inputs()[:2], img_shapes=IMG_SHAPES)


def test_bf16_model_on_cpu_provider_gets_clear_error(tmp_path, monkeypatch):
    import onnxruntime as ort

    class NoKernel:
        def __init__(self, *a, **k):
            raise RuntimeError("[ONNXRuntimeError] : 9 : NOT_IMPLEMENTED : Could not find an "
                               "implementation for MatMul(13) node with name 'node_MatMul_8'")

    f = _write_bf16_identity_model(tmp_path / "m.onnx")
    monkeypatch.setattr(ort, "InferenceSession", NoKernel)
    with pytest.raises(rn.RunnerError, match="no bfloat16 MatMul.*CUDAExecutionProvider"):
        load(f)

