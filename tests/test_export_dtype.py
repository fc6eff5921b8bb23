"""``qkrope export --model transformer`` without ``--dtype`` exports in the dtype the checkpoint's
weights are stored in (qkrope.export.checkpoint_dtype: the safetensors headers; a mixed
folder takes the majority of its float parameters) and prints which dtype and why.

The tests here use the tiny Qwen-Image transformer saved in bf16 and in fp32 (the tiny models'
own dtype, the one the rest of the suite exports), and hand-written safetensors files for the
mixed cases."""

from __future__ import annotations

import json

import pytest
import torch

from qkrope.cli import main
from qkrope.export.checkpoint_dtype import checkpoint_dtype, resolve_dtype
from qkrope.errors import InputError

safetensors_torch = pytest.importorskip("safetensors.torch", reason="requires safetensors")


def _folder(tmp_path, tensors: dict, name: str = "weights") -> str:
    d = tmp_path / name
    d.mkdir()
    safetensors_torch.save_file(tensors, str(d / "diffusion_pytorch_model.safetensors"))
    (d / "config.json").write_text("{}")
    return str(d)


def test_one_dtype(tmp_path):
    d = _folder(tmp_path, {"a": torch.zeros(4, 4, dtype=torch.bfloat16),
                           "b": torch.zeros(3, dtype=torch.bfloat16),
                           "i": torch.zeros(100, dtype=torch.int64)})  # integers do not count
    choice = checkpoint_dtype(d)
    assert choice.dtype == "bf16"
    assert "every float tensor" in choice.reason and "bfloat16" in choice.reason
    assert choice.stored == {"bfloat16": 19}


def test_mixed_takes_the_majority_and_says_so(tmp_path):
    # 64 bf16 elements against 8 fp32 (diffusers' _keep_in_fp32_modules keep a few in fp32)
    d = _folder(tmp_path, {"w": torch.zeros(8, 8, dtype=torch.bfloat16),
                           "norm": torch.zeros(8, dtype=torch.float32)})
    choice = checkpoint_dtype(d)
    assert choice.dtype == "bf16"
    share = 100 * 64 / 72
    assert f"{share:.3g}% bfloat16" in choice.reason and "more than one dtype" in choice.reason


def test_a_tie_goes_to_the_wider_type(tmp_path):
    d = _folder(tmp_path, {"a": torch.zeros(6, dtype=torch.float16),
                           "b": torch.zeros(6, dtype=torch.bfloat16)})
    assert checkpoint_dtype(d).dtype == "bf16"
    d2 = _folder(tmp_path, {"a": torch.zeros(6, dtype=torch.float32),
                            "b": torch.zeros(6, dtype=torch.bfloat16)}, name="other")
    assert checkpoint_dtype(d2).dtype == "fp32"


def test_a_type_qkrope_does_not_export_gives_fp32(tmp_path):
    d = _folder(tmp_path, {"a": torch.zeros(5, dtype=torch.float64)})
    choice = checkpoint_dtype(d)
    assert choice.dtype == "fp32" and "does not export" in choice.reason


def test_given_dtype_is_kept_and_checked(tmp_path):
    assert resolve_dtype("fp16", tmp_path).dtype == "fp16"  # the folder is not read
    with pytest.raises(InputError, match="--dtype must be one of"):
        resolve_dtype("fp64", tmp_path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")
    from qkrope.apps import tiny_pipeline as tp

    root = tmp_path_factory.mktemp("dtype")
    model = tp.tiny_transformer()
    tp.save_transformer(model, root / "fp32")
    tp.save_transformer(model.to(torch.bfloat16), root / "bf16")
    return root


@pytest.mark.parametrize("stored", ["bf16", "fp32"])
def test_export_without_dtype_uses_the_checkpoints(tiny, tmp_path, capsys, stored):
    out = tmp_path / "t.onnx"
    assert main(["export", "--model", "transformer", "--diffusers", str(tiny / stored),
                 "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert f"qkrope export: dtype {stored}: every float tensor" in err
    assert json.loads((tmp_path / "t.onnx.json").read_text())["dtype"] == stored


def test_export_with_dtype_says_as_given(tiny, tmp_path, capsys):
    out = tmp_path / "t.onnx"
    assert main(["export", "--model", "transformer", "--diffusers", str(tiny / "bf16"),
                 "--dtype", "fp32", "--out", str(out)]) == 0
    assert "qkrope export: dtype fp32: as given (--dtype)" in capsys.readouterr().err
    assert json.loads((tmp_path / "t.onnx.json").read_text())["dtype"] == "fp32"


def test_default_name_carries_the_chosen_dtype(tiny, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["export", "--model", "transformer", "--diffusers", str(tiny / "bf16")]) == 0
    assert (tmp_path / "qwen_image_transformer_bf16.onnx").is_file()
