"""FP8 with NVIDIA ModelOpt on a tiny random Qwen-Image transformer: the calibration inputs are
recorded from a run of the tiny pipeline (CalibrationRecorder), `qkrope quantize` calibrates
with the default layer selection and saves with ModelOpt's state, `qkrope export --quant fp8`
writes FP8 Q/DQ with the QKNormRoPE nodes intact, and ONNX Runtime runs it on the CPU."""

from __future__ import annotations

import fnmatch
import json

import numpy as np
import pytest
import torch

diffusers = pytest.importorskip("diffusers", reason="requires diffusers (pip install -e '.[test]')")
pytest.importorskip("transformers", reason="QwenImagePipeline requires transformers (test extras)")
pytest.importorskip("modelopt.torch.quantization",
                    reason="requires nvidia-modelopt (pip install -e '.[test]' or '.[fp8]')")

import onnx  # noqa: E402

from qkrope import contract, quantization  # noqa: E402
from qkrope.apps import tiny_pipeline as tp  # noqa: E402
from qkrope.cli import main  # noqa: E402
from qkrope.export import quantize  # noqa: E402
from qkrope.export.patch_diffusers import load_transformer  # noqa: E402
from qkrope.sidecars import ModelInfo  # noqa: E402

STEPS = 2  # pipeline steps recorded: one transformer call each (no true CFG)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    d = tmp_path_factory.mktemp("fp8")
    transformer = tp.tiny_transformer()
    tp.save_transformer(transformer, d / "float")
    pipe = tp.pipeline(transformer, tp.tiny_vae())
    pe, pm = tp.prompt_embeds(2, 7, seed=11, pad=2)
    with quantize.CalibrationRecorder(pipe.transformer) as rec:
        pipe(prompt_embeds=pe, prompt_embeds_mask=pm, height=32, width=32,
             num_inference_steps=STEPS, output_type="latent",
             generator=torch.Generator().manual_seed(0))
    rec.save(d / "calib.pt")
    assert main(["quantize", "--diffusers", str(d / "float"), "--calibration",
                 str(d / "calib.pt"), "--out", str(d / "fp8"), "--device", "cpu"]) == 0
    assert main(["export", "--model", "transformer", "--diffusers", str(d / "fp8"), "--quant",
                 "fp8", "--out", str(d / "fp8.onnx")]) == 0
    return d


def test_recorder_keeps_every_call_and_replays_it(work):
    batches = quantize.load_calibration(work / "calib.pt")
    assert len(batches) == STEPS
    kw = batches[0]["kwargs"]
    assert kw["hidden_states"].shape == (2, 16, tp.TRANSFORMER_CONFIG["in_channels"])
    assert kw["encoder_hidden_states"].shape[:2] == (2, 7)
    assert kw["img_shapes"] == [[(1, 4, 4)]] * 2
    float_model = load_transformer(str(work / "float"))
    with torch.no_grad():
        out = float_model(*batches[0]["args"], **batches[0]["kwargs"])
    assert out[0].shape == kw["hidden_states"].shape  # return_dict=False as the pipeline passed


def test_calibration_file_errors(tmp_path):
    with pytest.raises(quantization.InputError, match="no calibration batches"):
        quantize.save_calibration([], tmp_path / "c.pt")
    torch.save({"x": 1}, tmp_path / "other.pt")
    with pytest.raises(quantization.InputError, match="not a qkrope calibration file"):
        quantize.load_calibration(tmp_path / "other.pt")
    with pytest.raises(FileNotFoundError, match="CalibrationRecorder"):
        quantize.load_calibration(tmp_path / "missing.pt")


def test_default_layer_selection_is_every_linear_but_the_demo_exclusions(work):
    assert quantize.DEFAULT_EXCLUDED is quantization.DEFAULT_EXCLUDED  # --exclude's default
    model = load_transformer(str(work / "fp8"), quant="fp8")
    want = set()
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and not any(
                name == e or name.startswith(e + ".") for e in quantize.DEFAULT_EXCLUDED):
            want |= {f"{name}.input_quantizer", f"{name}.weight_quantizer"}
    got = {n for n, _ in quantize.fp8_quantizers(model)}
    assert got == want and len(want) == 2 * 14 * tp.TRANSFORMER_CONFIG["num_layers"]
    assert not any(fnmatch.fnmatch(n, f"{e}.*") for n in got for e in quantize.DEFAULT_EXCLUDED)


def test_modelopt_state_round_trip_and_refusal_of_requantising(work, capsys):
    files = {p.name for p in (work / "fp8").iterdir()}
    assert quantization.MODELOPT_STATE_FILE in files and "config.json" in files
    a = load_transformer(str(work / "fp8"), quant="fp8")
    b = load_transformer(str(work / "fp8"), quant="fp8")
    amax = {n: q.amax.clone() for n, q in quantize.fp8_quantizers(a)}
    assert all(torch.equal(q.amax, amax[n]) for n, q in quantize.fp8_quantizers(b))
    batch = quantize.load_calibration(work / "calib.pt")[0]
    with torch.no_grad():
        fq = a(*batch["args"], **batch["kwargs"])[0]
        with quantize.quantizers_disabled(a):
            flt = a(*batch["args"], **batch["kwargs"])[0]
    assert not torch.equal(fq, flt)  # the quantizers act, and disabling them is the float model
    assert main(["quantize", "--diffusers", str(work / "fp8"), "--calibration",
                 str(work / "calib.pt"), "--out", str(work / "again")]) == 2
    assert "carries ModelOpt quantisation" in capsys.readouterr().err


def test_fp8_graph(work):
    path = work / "fp8.onnx"
    model = onnx.load(str(path))
    nodes = list(model.graph.node)
    assert sum(n.op_type == contract.OP_TYPE for n in nodes) == 4
    info = ModelInfo.load(path)
    record = info.config.quantization
    meta = {p.key: p.value for p in model.metadata_props}
    assert json.loads(meta[quantization.METADATA_PROP]) == record
    assert info.opset >= 19 and record["mode"] == "fp8"
    fp8 = onnx.TensorProto.FLOAT8E4M3FN
    inits = {t.name: t for t in model.graph.initializer}
    qs = [n for n in nodes if n.op_type == "QuantizeLinear"]
    dqs = [n for n in nodes if n.op_type == "DequantizeLinear"]
    linears = record["quantized_linears"]
    assert len(qs) == len(linears) == record["qdq_pairs"] and len(dqs) == 2 * len(linears)
    consumers = {i: n for n in nodes for i in n.input}
    for owner in linears:
        key = f"{owner}.weight"
        assert key not in inits and key not in info.config.parameters  # only the FP8 copy
        w8 = inits[f"{key}_fp8"]
        assert w8.data_type == fp8
        dq = consumers[w8.name]
        assert dq.op_type == "DequantizeLinear" and consumers[dq.output[0]].op_type in (
            "MatMul", "Gemm")
        for s in dq.input[1:]:  # scales are scalar constants, not computed in the graph
            assert s in inits and list(inits[s].dims) == []
    for q in qs:
        assert inits[q.input[2]].data_type == fp8 and all(i in inits for i in q.input[1:])
        assert consumers[q.output[0]].op_type == "DequantizeLinear"
    onnx.checker.check_model(str(path), full_check=True)


def test_fp8_export_keeps_the_attention_pattern(work):
    """Only the Linears are quantised: every attention span (BMM1 -> mask -> Softmax -> BMM2)
    is the float export's, with no Q/DQ in it (FP8 attention is not implemented)."""
    from test_attention_pattern import attention_spans

    assert len(attention_spans(onnx.load(str(work / "fp8.onnx")))) == 2


def test_check_refuses_a_bf16_fp8_export(work, tmp_path, capsys):
    out = tmp_path / "bf16.onnx"
    assert main(["export", "--model", "transformer", "--diffusers", str(work / "fp8"), "--quant",
                 "fp8", "--dtype", "bf16", "--layers", "1", "--out", str(out)]) == 0
    onnx.checker.check_model(str(out), full_check=True)
    assert main(["check", str(out)]) == 2
    assert "--dtype fp32" in capsys.readouterr().err


def test_fp8_weights_are_modelopts_fake_quantised_weights_bit_for_bit(work):
    import ml_dtypes
    from onnx import numpy_helper

    model = load_transformer(str(work / "fp8"), quant="fp8")
    record = ModelInfo.load(work / "fp8.onnx").config.quantization
    graph = onnx.load(str(work / "fp8.onnx")).graph
    inits = {t.name: t for t in graph.initializer}
    consumers = {i: n for n in graph.node for i in n.input}
    modules = dict(model.named_modules())
    for owner in record["quantized_linears"]:
        lin = modules[owner]
        w8 = numpy_helper.to_array(inits[f"{owner}.weight_fp8"])
        scale = numpy_helper.to_array(inits[f"{owner}.weight_quantizer.scale"])
        dq = w8.astype(ml_dtypes.float8_e4m3fn).astype(np.float32) * scale  # DequantizeLinear
        with torch.no_grad():
            want = lin.weight_quantizer(lin.weight).numpy()
        if consumers[consumers[f"{owner}.weight_fp8"].output[0]].op_type == "MatMul":
            dq = dq.T  # MatMul(x, W^T): stored transposed, [in, out]
        assert np.array_equal(dq, want), owner


def test_fp8_export_streams_each_weight_once(work, tmp_path, monkeypatch):
    """The FP8 export reads every weight from the folder's shards once, as it writes it (the
    quantised Linears' float weights quantised then), and each quantizer's tensors once; the
    float initializers of the quantised Linears are not in the file."""
    from qkrope import diffusers_weights
    from qkrope.export import onnx_export, streaming

    reads: dict[str, int] = {}
    real = diffusers_weights.read_tensor

    def counting(header):
        reads[header.key] = reads.get(header.key, 0) + 1
        return real(header)

    monkeypatch.setattr(diffusers_weights, "read_tensor", counting)
    monkeypatch.setattr(streaming, "read_tensor", counting)
    info, _ = onnx_export.export_transformer(tmp_path / "s.onnx", work / "fp8", quant="fp8",
                                             progress=False)
    record = info.config.quantization
    assert reads and set(reads.values()) == {1}
    weights = {k for k in reads if "_quantizer." not in k}
    assert weights == set(info.config.parameters) | {f"{o}.weight"
                                                     for o in record["quantized_linears"]}
    names = {t.name for t in onnx.load(str(tmp_path / "s.onnx")).graph.initializer}
    assert not names & {f"{o}.weight" for o in record["quantized_linears"]}


def test_onnxruntime_needs_the_qdq_option_and_the_runner_sets_it(work):
    import onnxruntime as ort

    from qkrope.runtime import load

    path = str(work / "fp8.onnx")
    with pytest.raises(Exception, match="MatMulIntegerToFloat|INVALID_GRAPH|NOT_IMPLEMENTED"):
        ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    runner = load(path)  # qkrope's runner sets session.disable_quant_qdq for a quantised model
    hs = torch.randn(1, 16, tp.TRANSFORMER_CONFIG["in_channels"])
    ehs = torch.randn(1, 5, tp.TRANSFORMER_CONFIG["joint_attention_dim"])
    out = runner.run_qwen(hs, ehs, img_shapes=[(1, 4, 4)], timestep=torch.tensor([0.5]))
    assert out.shape == (1, 16, 16) and torch.isfinite(out).all()


def test_check_against_modelopts_fake_quant_model(work, capsys):
    """`qkrope check` of the FP8 export: weights and every quantizer bit for bit (one-step
    rounding ties aside, see qkrope.apps.check_fp8), the end-to-end bound where the FP8 values
    of both runs agree."""
    from qkrope.apps.check_fp8 import check_fp8

    assert main(["check", str(work / "fp8.onnx")]) == 0
    text = capsys.readouterr().out
    assert "ModelOpt fake-quant" in text and "PASSED" in text
    report = check_fp8(work / "fp8.onnx", img_shapes=[(1, 4, 4)], txt_len=6, batch=1, seed=3)
    assert report.passed and report.weights_checked == report.quantizers_checked == 25
    assert report.weight_mismatches == 0 and report.bad_quantizer_elements == 0
    assert report.max_abs_vs_float > report.max_abs_vs_modelopt  # quantisation is in the graph


def test_check_detects_a_wrong_scale(work, tmp_path):
    """A model whose one input scale is off by one float32 ulp fails comparison 2 (the FP8
    values are no longer ModelOpt's)."""
    import shutil

    from onnx import numpy_helper

    from qkrope.apps.check_fp8 import check_fp8

    bad = tmp_path / "bad.onnx"
    model = onnx.load(str(work / "fp8.onnx"))
    for i, t in enumerate(model.graph.initializer):
        if t.name == "transformer_blocks.0.attn.to_q.input_quantizer.scale":
            v = numpy_helper.to_array(t) * np.float32(1.01)
            model.graph.initializer[i].CopyFrom(numpy_helper.from_array(v.astype(np.float32),
                                                                        t.name))
    onnx.save(model, str(bad))
    shutil.copy(work / "fp8.onnx.json", str(bad) + ".json")
    info = json.loads((tmp_path / "bad.onnx.json").read_text())
    from qkrope._fileio import sha256_file

    info["model_sha256"] = sha256_file(bad)
    (tmp_path / "bad.onnx.json").write_text(json.dumps(info))
    report = check_fp8(bad, img_shapes=[(1, 4, 4)], txt_len=6, batch=1)
    assert not report.passed and report.bad_quantizer_elements > 0


def test_tiny_pipeline_runs_on_the_fp8_export(work):
    """The drop-in transformer on the FP8 export in the tiny pipeline; its latents are compared
    with the pipeline on ModelOpt's fake-quant model (reported: FP8 rounding crossings between
    the two runs have no float bound) and must differ from the float pipeline's."""
    from qkrope.runtime import load_transformer as load_exported

    fq = load_transformer(str(work / "fp8"), quant="fp8")
    vae = tp.tiny_vae()
    pe, pm = tp.prompt_embeds(1, 7, seed=1)
    kw = dict(prompt_embeds=pe, prompt_embeds_mask=pm, height=32, width=32,
              num_inference_steps=2, output_type="latent")
    ref = tp.pipeline(fq, vae)(**kw, generator=torch.Generator().manual_seed(0)).images
    ours = tp.pipeline(fq, vae)
    ours.transformer = load_exported(work / "fp8.onnx")
    got = ours(**kw, generator=torch.Generator().manual_seed(0)).images
    with quantize.quantizers_disabled(fq):
        flt = tp.pipeline(fq, vae)(**kw, generator=torch.Generator().manual_seed(0)).images
    assert got.shape == ref.shape and torch.isfinite(got).all()
    diff, quant_err = float((got - ref).abs().max()), float((got - flt).abs().max())
    print(f"FP8 pipeline latents: max |ORT - ModelOpt| {diff:.3g}, max |ORT - float| "
          f"{quant_err:.3g}, bound without crossings {tp.latent_bound(ref):.3g}")
    assert diff < quant_err


def test_save_quantized_replaces_the_folder_whole_or_not_at_all(work, tmp_path, monkeypatch):
    """Every write/rename step of save_quantized failing in turn (fake_tensorrt's fault
    injection): the folder holds the old model or the new one, complete, and no staging folder
    is left; the failure is one line naming the full disk."""
    import shutil

    from fake_tensorrt import fail_each_write_step
    from safetensors.torch import load_file

    model = load_transformer(str(work / "fp8"), quant="fp8")
    name, q = quantize.fp8_quantizers(model)[0]
    q.amax = q.amax * 2  # the new model differs from the old one in one amax
    out = tmp_path / "q"
    key = f"{name}._amax"

    def amax_on_disk():
        (f,) = out.glob("*.safetensors")
        return float(load_file(str(f))[key])

    def reset():
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(work / "fp8", out)

    want = {float(q.amax) / 2, float(q.amax)}

    def after(k):
        assert {p.name for p in out.iterdir()} >= {"config.json",
                                                  quantization.MODELOPT_STATE_FILE}, k
        assert amax_on_disk() in want, k
        assert [p.name for p in tmp_path.iterdir()] == ["q"], k  # no staging folder left

    steps = fail_each_write_step(monkeypatch, lambda: quantize.save_quantized(model, out),
                                 reset=reset, after=after)
    assert "os.rename" in steps and amax_on_disk() == float(q.amax)


def test_quantizers_the_export_cannot_express_are_refused(work, tmp_path, capsys):
    """ModelOpt's stock FP8_DEFAULT_CFG also quantises the LayerNorm inputs: no Q/DQ form is
    written for those, so the export refuses (naming the quantizer and qkrope quantize) rather
    than dropping them."""
    import modelopt.torch.quantization as mtq

    model = load_transformer(str(work / "float"))
    batch = quantize.load_calibration(work / "calib.pt")[0]
    quantize.calibrate(model, [batch], config=mtq.FP8_DEFAULT_CFG)
    quantize.save_quantized(model, tmp_path / "stock")
    assert main(["export", "--model", "transformer", "--diffusers", str(tmp_path / "stock"),
                 "--quant", "fp8", "--out", str(tmp_path / "m.onnx")]) == 2
    err = capsys.readouterr().err
    assert "_norm" in err and "input_quantizer is enabled" in err and "qkrope quantize" in err
    assert not (tmp_path / "m.onnx").exists()


def test_fp8_step_is_the_spacing_of_float8_e4m3fn():
    """check_fp8's one-step rule: _fp8_step(v * s, s) is the gap from v to the next float8
    e4m3fn value up, for every finite positive value and two scales."""
    import ml_dtypes

    from qkrope.apps.check_fp8 import _fp8_step

    values = np.arange(1, 0x7E, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    gaps = np.diff(np.append(values, 448.0))  # up to 0x7D = 416; the next value is 448
    for s in (1.0, 0.0123):
        assert np.allclose(_fp8_step(values * s, s), gaps * s, rtol=1e-12, atol=0)


def test_recorder_keeps_copies_of_the_first_calls_and_unhooks():
    lin = torch.nn.Linear(4, 4)
    x = torch.ones(2, 4)
    with quantize.CalibrationRecorder(lin, max_calls=2) as rec:
        for k in range(3):
            lin(x * k)
        lin(input=x)  # keyword arguments are recorded too (this call is past max_calls)
    x.fill_(7.0)
    lin(x)  # after the context: not recorded
    assert len(rec.batches) == 2
    assert [float(b["args"][0].max()) for b in rec.batches] == [0.0, 1.0]
    assert rec.batches[1]["args"][0] is not x and rec.batches[1]["kwargs"] == {}
    with pytest.raises(quantization.InputError, match="max_calls"):
        quantize.CalibrationRecorder(lin, max_calls=0)
