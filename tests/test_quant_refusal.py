"""Quantisation is never dropped silently: weights that carry ModelOpt quantizer state
(``*_quantizer._amax`` tensors, ``modelopt_state.pth``) are exported quantised or refused with
the command that does it. ModelOpt itself is not needed here: the folders are a tiny random
QwenImageTransformer2DModel saved by diffusers, with quantizer tensors added to its safetensors
file the way ``save_pretrained`` writes them for a ModelOpt-quantised model."""

from __future__ import annotations

import pytest
import torch

from qkrope import quantization
from qkrope.cli import main

diffusers = pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")
from safetensors.torch import load_file, save_file  # noqa: E402

CONFIG = dict(patch_size=2, in_channels=16, out_channels=4, num_layers=1, attention_head_dim=32,
              num_attention_heads=2, joint_attention_dim=24, axes_dims_rope=(8, 12, 12))
AMAX_KEYS = ("transformer_blocks.0.attn.to_q.input_quantizer._amax",
             "transformer_blocks.0.attn.to_q.weight_quantizer._amax")


def _folder(path, *, amax=True, state_file=False):
    torch.manual_seed(0)
    diffusers.QwenImageTransformer2DModel(**CONFIG).save_pretrained(str(path))
    if amax:
        (weights,) = path.glob("*.safetensors")
        state = load_file(str(weights))
        state.update({k: torch.tensor(3.0) for k in AMAX_KEYS})
        save_file(state, str(weights))
    if state_file:
        torch.save({"modelopt_state_dict": []}, path / quantization.MODELOPT_STATE_FILE)
    return path


def test_quantized_folder_is_refused_with_the_command(tmp_path, capsys):
    d = _folder(tmp_path / "q")
    out = tmp_path / "m.onnx"
    assert main(["export", "--model", "transformer", "--diffusers", str(d), "--out",
                 str(out)]) == 2
    err = capsys.readouterr().err
    assert "2 quantizer tensors" in err and AMAX_KEYS[0] in err
    assert f"qkrope export --model transformer --diffusers {d} --quant fp8" in err
    assert not out.exists() and not (tmp_path / "m.onnx.json").exists()


def test_pipeline_folder_and_state_file_alone_are_refused(tmp_path, capsys):
    d = _folder(tmp_path / "pipe" / "transformer", amax=False, state_file=True)
    assert main(["export", "--model", "transformer", "--diffusers", str(d.parent), "--out",
                 str(tmp_path / "m.onnx")]) == 2
    err = capsys.readouterr().err
    assert quantization.MODELOPT_STATE_FILE in err and "--quant fp8" in err


def test_quant_without_modelopt_state_names_the_quantize_command(tmp_path, capsys):
    d = _folder(tmp_path / "q")  # amax tensors, no modelopt_state.pth: ModelOpt cannot restore
    assert main(["export", "--model", "transformer", "--diffusers", str(d), "--quant", "fp8",
                 "--out", str(tmp_path / "m.onnx")]) == 2
    err = capsys.readouterr().err
    assert "no modelopt_state.pth" in err and "qkrope quantize" in err
    plain = _folder(tmp_path / "plain", amax=False)
    assert main(["export", "--model", "transformer", "--diffusers", str(plain), "--quant", "fp8",
                 "--out", str(tmp_path / "m.onnx")]) == 2
    assert "is not quantised" in capsys.readouterr().err


def test_quant_needs_an_fp8_opset(tmp_path, capsys):
    d = _folder(tmp_path / "q", state_file=True)
    assert main(["export", "--model", "transformer", "--diffusers", str(d), "--quant", "fp8",
                 "--opset", "18", "--out", str(tmp_path / "m.onnx")]) == 2
    assert "--opset 19 or later" in capsys.readouterr().err


def test_attention_weights_with_quantizer_state_are_refused(tmp_path, capsys):
    w = tmp_path / "attn.pt"
    torch.save({"to_q.weight": torch.zeros(32, 32),
                "to_q.input_quantizer._amax": torch.tensor(1.0)}, w)
    assert main(["export", "--heads", "2", "--head-dim", "16", "--weights", str(w), "--out",
                 str(tmp_path / "a.onnx")]) == 2
    err = capsys.readouterr().err
    assert "to_q.input_quantizer._amax" in err and "qkrope quantize" in err


@pytest.mark.parametrize("as_folder", [True, False])
def test_refit_weights_with_quantizer_state_are_refused(tmp_path, as_folder):
    from qkrope.apps.refit import load_state_dict

    d = _folder(tmp_path / "q")
    src = dict(diffusers=str(d)) if as_folder else dict(
        state_dict=str(next(d.glob("*.safetensors"))))
    with pytest.raises(quantization.QuantizedModelError, match="--quant fp8"):
        load_state_dict(**src)
    plain = _folder(tmp_path / "plain", amax=False)
    assert not quantization.quantizer_keys(load_state_dict(diffusers=str(plain)))


def test_folder_scan_reads_headers_only(tmp_path):
    d = _folder(tmp_path / "q")
    q = quantization.folder_quantization(d)
    assert q.quantized and q.quantizer_keys == tuple(sorted(AMAX_KEYS)) and q.state_file is None
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "diffusion_pytorch_model.safetensors").write_bytes(b"\x01")
    with pytest.raises(quantization.InputError, match="not a safetensors file"):
        quantization.folder_quantization(bad)


def test_folder_scan_reads_only_the_model_weights_and_says_what_a_bad_one_is(tmp_path):
    """Files diffusers does not load (notes.bin, random bytes, another safetensors) are not
    scanned; a weights .bin that is no torch file is one InputError, not torch's RuntimeError
    (mmap on a non-zip file) or UnpicklingError."""
    d = _folder(tmp_path / "plain", amax=False)
    (d / "notes.bin").write_text("hello\n")
    (d / "random.bin").write_bytes(bytes(range(256)) * 4)
    (d / "lora.safetensors").write_bytes(b"\x01")
    assert not quantization.folder_quantization(d).quantized
    for junk in (b"hello\n", bytes(range(256)) * 4, b"PK\x03\x04 truncated zip"):
        (d / "diffusion_pytorch_model.bin").write_bytes(junk)
        with pytest.raises(quantization.InputError,
                           match=r"diffusion_pytorch_model\.bin is not a readable torch-saved "
                                 r"state dict \(.*; \w+\)\. Fix: remove it") as exc:
            quantization.folder_quantization(d)
        assert "\n" not in str(exc.value) and "weights_only" not in str(exc.value)
    # an old-format (non-zip) torch.save is read without mmap
    torch.save({"a.input_quantizer._amax": torch.tensor(1.0)}, d / "diffusion_pytorch_model.bin",
               _use_new_zipfile_serialization=False)
    assert quantization.folder_quantization(d).quantizer_keys == ("a.input_quantizer._amax",)
