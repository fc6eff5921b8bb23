"""qkrope.runtime.onnx_file: reading an ONNX file, and queries of its QKNormRoPE nodes."""

from __future__ import annotations

from _tiny_model import write_tiny_onnx

from qkrope.runtime import onnx_file


def test_count_nodes_and_head_dim(tmp_path):
    p = write_tiny_onnx(tmp_path / "m.onnx", sidecar=False)
    assert onnx_file.count_plugin_nodes(p) == ["img_qknorm", "txt_qknorm"]
    assert onnx_file.head_dim_from_onnx(p) == 16


import pytest  # noqa: E402
from _tiny_model import move_weights_out  # noqa: E402


def _outside_cases(tmp_path):
    """(location written in the model, how its bytes are placed) for every way out."""
    outside = tmp_path / "outside" / "w.bin"

    def link(model_dir):  # a file in the folder that is a symlink out of it
        outside.parent.mkdir(parents=True, exist_ok=True)
        outside.write_bytes(bytes(64))
        (model_dir / "w.bin").symlink_to(outside)
        return "w.bin", model_dir / "unused.bin"

    return {
        "absolute": lambda d: (str(outside), outside),
        "dotdot": lambda d: ("../outside/w.bin", outside),
        "dotdot-inside": lambda d: ("sub/../../outside/w.bin", outside),
        "symlink": link,
    }


CASES = ["absolute", "dotdot", "dotdot-inside", "symlink"]


@pytest.mark.parametrize("case", CASES)
def test_external_data_outside_the_models_folder_is_refused(tmp_path, case):
    """Every external-data location must be relative, free of '..' and resolve (symlinks
    followed) inside the model's folder: checked_onnx_model, what every reader calls first,
    refuses the rest, naming the tensor."""
    d = tmp_path / "model"
    d.mkdir()
    path = write_tiny_onnx(d / "m.onnx")
    location, data = _outside_cases(tmp_path)[case](d)
    move_weights_out(path, location, data=data if case != "symlink" else None)
    with pytest.raises(onnx_file.OnnxModelError, match=r"tensor 'w'.*outside the model's folder"):
        onnx_file.checked_onnx_model(path)


def test_external_data_inside_the_folder_is_listed(tmp_path):
    path = write_tiny_onnx(tmp_path / "m.onnx")
    move_weights_out(path, "m.onnx.data")
    assert onnx_file.external_data_files(onnx_file.read_onnx_model(path), path) == [tmp_path / "m.onnx.data"]
    onnx_file.checked_onnx_model(path)
    (tmp_path / "m.onnx.data").unlink()
    with pytest.raises(onnx_file.OnnxModelError, match="is missing"):
        onnx_file.checked_onnx_model(path)


@pytest.mark.parametrize("surface", ["build", "check", "load", "triton-repo"])
@pytest.mark.parametrize("case", ["dotdot", "symlink"])
def test_every_reader_refuses_external_data_from_outside(tmp_path, capsys, monkeypatch,
                                                         surface, case):
    """build (before TensorRT's parser), check, load (before ONNX Runtime) and triton-repo
    --backend onnxruntime (before copying) refuse the model in one line; nothing is written."""
    import sys

    from qkrope import cli
    from qkrope.runtime import load

    monkeypatch.setitem(sys.modules, "tensorrt", None)
    d = tmp_path / "model"
    d.mkdir()
    path = write_tiny_onnx(d / "m.onnx")
    location, data = _outside_cases(tmp_path)[case](d)
    move_weights_out(path, location, data=data if case != "symlink" else None)
    before = sorted(p.name for p in d.iterdir())
    if surface == "load":
        with pytest.raises(onnx_file.OnnxModelError, match="outside the model's folder"):
            load(path)
        return
    argv = {"build": ["build", str(path), "-o", str(d / "m.engine")],
            "check": ["check", str(path)],
            "triton-repo": ["triton-repo", "--backend", "onnxruntime", "--onnx", str(path),
                            "-o", str(tmp_path / "repo")]}[surface]
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "outside the model's folder" in err and err.count("\n") == 1, err
    assert sorted(p.name for p in d.iterdir()) == before and not (tmp_path / "repo").exists()


def test_the_onnx_reading_names_have_one_home():
    """Reading ONNX files lives in onnx_file only: trt_utils (engine files, the GPU) offers none
    of its names, so no caller reaches them through a second module."""
    from qkrope.runtime import trt_utils

    for name in ("read_onnx_model", "external_data_files", "plugin_node_names",
                 "count_plugin_nodes", "head_dim_from_onnx"):
        assert hasattr(onnx_file, name) and not hasattr(trt_utils, name), name
