"""Issue 34, class 3: values the target cannot hold are refused where they enter, in export and
quantize as in refit (one check, qkrope.weight_values): a NaN/inf weight; an fp32 weight beyond
fp16's range with --dtype fp16 (the tensor named, --dtype bf16 offered); a calibrated amax that
is NaN, infinite or <= 0 in a quantised folder exported with --quant fp8."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")

from _oneline import error_line  # noqa: E402

from qkrope import weight_values as wv  # noqa: E402
from qkrope.apps import tiny_pipeline as tp  # noqa: E402
from qkrope.cli import main  # noqa: E402

FP16_MAX = torch.finfo(torch.float16).max  # 65504; from 65520 up fp32 rounds to inf


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = tmp_path_factory.mktemp("values") / "tiny"
    tp.tiny_transformer().save_pretrained(str(d))
    return d


def _with(saved: Path, tmp_path: Path, key: str, value: float) -> Path:
    """A copy of the folder whose tensor ``key`` has one element set to ``value``."""
    from safetensors.torch import load_file, save_file

    d = tmp_path / "model"
    shutil.copytree(saved, d)
    f = d / "diffusion_pytorch_model.safetensors"
    state = load_file(str(f))
    state[key] = state[key].clone()
    state[key].view(-1)[3] = value
    save_file(state, str(f), metadata={"format": "pt"})
    return d


# a key the one-block export writes (block 0's attention output projection)
KEY = "transformer_blocks.0.attn.to_out.0.weight"


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_export_refuses_a_nonfinite_weight(saved, tmp_path, capsys, value):
    d = _with(saved, tmp_path, KEY, value)
    out = tmp_path / "o" / "m.onnx"
    rc = main(["export", "--model", "transformer", "--diffusers", str(d), "--layers", "1",
               "--out", str(out)])
    line = error_line(capsys)
    assert rc == 2 and KEY in line and "NaN or infinite" in line
    assert not out.exists()


def test_export_fp16_refuses_an_fp32_weight_beyond_fp16_and_offers_bf16(saved, tmp_path, capsys):
    d = _with(saved, tmp_path, KEY, 1.0e5)  # > 65520: inf in fp16
    out = tmp_path / "o" / "m.onnx"
    rc = main(["export", "--model", "transformer", "--diffusers", str(d), "--layers", "1",
               "--dtype", "fp16", "--out", str(out)])
    line = error_line(capsys)
    assert rc == 2 and KEY in line and "float16" in line and "--dtype bf16" in line
    assert not out.exists()


def test_export_fp16_names_every_tensor_beyond_fp16(saved, tmp_path, capsys):
    """Issue 34 class 3: which tensors overflow, not only the first: every key the export
    writes that fp16 cannot hold is named in the one line (the first few, then a count)."""
    from safetensors.torch import load_file, save_file

    keys = [KEY, "transformer_blocks.0.attn.to_q.weight", "transformer_blocks.0.attn.to_k.weight"]
    d = tmp_path / "model"
    shutil.copytree(saved, d)
    f = d / "diffusion_pytorch_model.safetensors"
    state = {k: v.clone() for k, v in load_file(str(f)).items()}
    for key in keys:
        state[key].view(-1)[1] = 1.0e5
    save_file(state, str(f), metadata={"format": "pt"})
    out = tmp_path / "o" / "m.onnx"
    rc = main(["export", "--model", "transformer", "--diffusers", str(d), "--layers", "1",
               "--dtype", "fp16", "--out", str(out)])
    line = error_line(capsys)
    assert rc == 2 and "3 tensors have values beyond float16" in line and "--dtype bf16" in line
    assert all(key in line for key in keys), line
    assert not out.exists()
    # more than NAMED: the first few by name, the rest counted
    with pytest.raises(wv.WeightValueError, match=r"7 tensors .* \(\+2 more\)"):
        wv.checked_cast(torch.tensor([1.0e5]), torch.float16, name="a", source="s",
                        others=lambda: [f"b{i}" for i in range(6)])


def test_the_check_is_the_conversion_itself():
    """Exactly the values the cast makes infinite: 65504 and 65519 round to 65504 (kept), 65520
    rounds to inf (refused); bf16 holds float32's range; NaN refused for every dtype."""
    ok = torch.tensor([1.0, FP16_MAX, 65519.0])
    assert torch.equal(wv.checked_cast(ok, torch.float16, name="k", source="s"),
                       ok.to(torch.float16))
    with pytest.raises(wv.WeightValueError, match=r"k: 1 of 2 values are beyond float16"):
        wv.checked_cast(torch.tensor([1.0, 65520.0]), torch.float16, name="k", source="s")
    big = torch.tensor([1.0e30])
    assert torch.isfinite(wv.checked_cast(big, torch.bfloat16, name="k", source="s")).all()
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        with pytest.raises(wv.WeightValueError, match="NaN or infinite"):
            wv.checked_cast(torch.tensor([float("nan")]), dtype, name="k", source="s")


def test_refit_uses_the_same_check():
    """One home: refit's nonfinite verdicts come from qkrope.weight_values."""
    from qkrope.apps import refit

    assert refit.cast_problem is wv.cast_problem


@pytest.mark.parametrize("amax", [float("nan"), float("inf"), 0.0, -1.0])
def test_amax_problems(amax):
    assert wv.amax_problem(torch.tensor(amax)) is not None
    assert wv.amax_problem(torch.tensor(0.5)) is None


@pytest.mark.parametrize("amax", [float("nan"), float("-inf"), 0.0])
def test_quantised_folder_with_a_bad_amax_is_refused_before_the_trace(tmp_path, monkeypatch,
                                                                    amax):
    """restore_quantized (the --quant fp8 export's first step) reads the quantizer tensors and
    refuses a NaN/inf/<=0 amax, naming it, before the model is traced. ModelOpt itself is
    stood in for (its restore is not what is tested)."""
    from safetensors.torch import save_file

    from qkrope import diffusers_weights as dw
    from qkrope import quantization
    from qkrope.export import quantize

    d = tmp_path / "q"
    d.mkdir()
    name = "transformer_blocks.0.attn.to_q.input_quantizer._amax"
    save_file({"w": torch.ones(2, 2), name: torch.tensor(amax)},
              str(d / "diffusion_pytorch_model.safetensors"))
    (d / "config.json").write_text(json.dumps({"_class_name": "X"}))
    torch.save({"modelopt_state_dict": []}, d / quantization.MODELOPT_STATE_FILE)

    class FakeMto:
        @staticmethod
        def restore_from_modelopt_state(model, modelopt_state):
            return model

    monkeypatch.setattr(quantize, "_modelopt", lambda: (None, FakeMto))
    with pytest.raises(quantize.QuantizeError) as info:
        quantize.restore_quantized(torch.nn.Module(), d, headers=dw.tensor_headers(d))
    msg = str(info.value)
    assert "\n" not in msg and name in msg and "qkrope quantize" in msg


def test_quantize_refuses_weights_that_are_not_finite_as_loaded():
    from qkrope.export import quantize

    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        model.weight[0, 0] = float("inf")
    with pytest.raises(wv.WeightValueError, match=r"weight: 1 of 4 .*--dtype bf16"):
        quantize.check_loaded_weights(model, source="--diffusers D", dtype="fp16")
    model.weight.data.fill_(1.0)
    quantize.check_loaded_weights(model, source="--diffusers D", dtype="fp16")
