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

from qkrope import contract, families, quantization  # noqa: E402
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
    (tmp_path / "notes.md").write_text("# mine\n")
    from qkrope._fileio import OutputIsInputError

    with pytest.raises(OutputIsInputError, match="is a text file, not a qkrope calibration"):
        quantize.save_calibration([{"args": (), "kwargs": {}}], tmp_path / "notes.md")
    assert (tmp_path / "notes.md").read_text() == "# mine\n"
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


@pytest.mark.parametrize("flags", [["--blocks"], ["--layers", "-3"], ["--layers", "999"],
                                   ["--layers", "1"]], ids=["blocks", "layers-3", "layers999",
                                                            "layers1"])
def test_check_refuses_block_flags_on_an_fp8_export(work, capsys, flags):
    """Issue 34 class 6: ``qkrope check --blocks`` / ``--layers K`` on an FP8 export are
    refused in one line before any work (they used to run the whole-model FP8 check, which
    passed whatever they asked)."""
    rc = main(["check", str(work / "fp8.onnx"), *flags])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and err.count("\n") == 1, err
    assert "FP8 export" in err or "pass 1 to" in err, err


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
    out = runner.run_positions(hs, ehs, img_shapes=[(1, 4, 4)], timestep=torch.tensor([0.5]))
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


@pytest.mark.parametrize("exchange", [True, False], ids=["renameat2", "two-renames"])
def test_save_quantized_replaces_the_folder_whole_or_not_at_all(work, tmp_path, monkeypatch,
                                                                exchange):
    """Every write/rename step of save_quantized failing in turn (fake_tensorrt's fault
    injection, the safetensors write included), with the atomic exchange and with the
    two-rename fallback: the folder holds the old model or the new one, complete, and no
    staging folder is left; the failure is one line naming the full disk."""
    import shutil

    from fake_tensorrt import fail_each_write_step
    from safetensors.torch import load_file

    from qkrope import _fileio

    if not exchange:
        monkeypatch.setattr(_fileio, "_exchange", lambda a, b: False)

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
                                 reset=reset, after=after,
                                 extra=(("safetensors.torch", "save_file"),))
    assert {"safetensors.torch.save_file", "os.fsync"} <= set(steps), steps
    assert ("os.rename" in steps) == (not exchange), steps
    assert amax_on_disk() == float(q.amax)


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


def _tiny_flux(family):
    """A tiny FLUX.1 (guidance-distilled, like dev) or FLUX.2 transformer built in code, and one
    forward's inputs (as the pipelines pass them)."""
    from diffusers import Flux2Transformer2DModel, FluxTransformer2DModel

    g = torch.Generator().manual_seed(0)
    common = dict(num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2,
                  in_channels=4, joint_attention_dim=8)
    if family == "flux1":
        model = FluxTransformer2DModel(**common, pooled_projection_dim=8, guidance_embeds=True,
                                       axes_dims_rope=(4, 6, 6))
        extra = {"pooled_projections": torch.randn(1, 8, generator=g)}
        n_axes = 3
    else:
        model = Flux2Transformer2DModel(**common, timestep_guidance_channels=8,
                                        axes_dims_rope=(4, 4, 4, 4))
        extra, n_axes = {}, 4
    kwargs = dict(hidden_states=torch.randn(1, 16, 4, generator=g),
                  encoder_hidden_states=torch.randn(1, 5, 8, generator=g),
                  timestep=torch.tensor([0.5]), guidance=torch.tensor([3.5]),
                  img_ids=torch.arange(16 * n_axes).reshape(16, n_axes) % 4,
                  txt_ids=torch.zeros(5, n_axes), return_dict=False, **extra)
    return model.eval(), kwargs


@pytest.mark.parametrize("family", ["flux1", "flux2"])
def test_flux_default_selection_is_every_linear_of_the_blocks(family):
    """FLUX's default exclusions (x_embedder, context_embedder, the timestep/guidance embedder,
    FLUX.2's shared modulations, norm_out, proj_out) are real top-level modules, and with them
    calibration quantises exactly the Linear layers inside the transformer blocks, the single
    blocks' own proj_out included."""
    model, kwargs = _tiny_flux(family)
    exclude = quantization.default_excluded(model)
    assert exclude == families.by_name(family).fp8_excluded
    assert set(exclude) <= {n for n, _ in model.named_children()}
    quantize.calibrate(model, [{"args": (), "kwargs": kwargs}], config=quantize.fp8_config(exclude))
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    in_blocks = [n for n in linears if n.split(".")[0] in ("transformer_blocks",
                                                           "single_transformer_blocks")]
    got = {n for n, _ in quantize.fp8_quantizers(model)}
    assert got == {f"{n}.{role}_quantizer" for n in in_blocks for role in ("input", "weight")}
    # FLUX.1: a double block's 2 AdaLN, 4 + 4 attention and 2 + 2 MLP Linears, a single
    # block's AdaLN, proj_mlp, proj_out and q/k/v; FLUX.2: no AdaLN in the blocks (the shared
    # modulations), a single block's fused qkv+MLP projection and its output.
    assert len(in_blocks) == (14 + 6 if family == "flux1" else 12 + 2)
    assert len(linears) > len(in_blocks)
    if family == "flux1":
        assert "single_transformer_blocks.0.proj_out.weight_quantizer" in got
        assert "proj_out.weight_quantizer" not in got


def test_default_selection_by_class_refuses_another_model():
    assert quantization.default_excluded("QwenImageTransformer2DModel") is quantize.DEFAULT_EXCLUDED
    with pytest.raises(quantization.InputError, match=r"no default FP8 layer selection for "
                                                      r"SD3Transformer2DModel: qkrope knows "
                                                      r"QwenImageTransformer2DModel, Flux"):
        quantization.default_excluded("SD3Transformer2DModel")


# --------------------------------------------------------------------------------------------
# Nothing lost, one-line errors (issue 26): qkrope quantize's paths, inputs and its commit
# --------------------------------------------------------------------------------------------

import os  # noqa: E402
import shutil  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402
from pathlib import Path  # noqa: E402

from qkrope import _fileio  # noqa: E402


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file()}


def _quantize(capsys, diffusers, calibration, out, *extra):
    rc = main(["quantize", "--diffusers", str(diffusers), "--calibration", str(calibration),
               "--out", str(out), "--device", "cpu", *extra])
    return rc, capsys.readouterr().err


def _one_line_error(rc, err):
    """Exit 2 and one error line (the last; progress lines may come before it), no traceback."""
    assert rc == 2 and "Traceback" not in err, (rc, err)
    tail = err[err.find("qkrope quantize: error:"):] if "quantize: error" in err else \
        err[err.find("qkrope export: error:"):]
    assert tail.count("\n") == 1 and ": error: " in tail, err


@pytest.mark.parametrize("layout", ["contains-diffusers", "contains-calibration", "is-diffusers",
                                    "is-pipeline-transformer", "weights-linked-into-out",
                                    "other-folder", "a-file"])
def test_quantize_out_that_would_destroy_something_is_refused(work, tmp_path, capsys, layout):
    """--out containing the float model or the calibration file, being the model folder (also
    a pipeline's transformer/), a folder that is not a previous quantised model, or a file: refused
    in one line before any work, nothing changed."""
    root = tmp_path / "root"
    float_dir, calib = root / "models" / "float", root / "calib.pt"
    shutil.copytree(work / "float", float_dir)
    shutil.copyfile(work / "calib.pt", calib)
    diffusers, out = float_dir, root / "q"
    if layout == "contains-diffusers":
        out = root / "models"
    elif layout == "contains-calibration":
        out = root
    elif layout == "is-diffusers":
        out = float_dir
    elif layout == "is-pipeline-transformer":
        pipe = root / "pipe"
        shutil.move(float_dir, pipe / "transformer")
        (pipe / "model_index.json").write_text("{}")
        diffusers, out = pipe, pipe / "transformer"
    elif layout == "weights-linked-into-out":  # a previous output holds the float weights
        shutil.copytree(work / "fp8", out)
        weights = float_dir / "diffusion_pytorch_model.safetensors"
        shutil.move(weights, out / "float-weights.safetensors")
        weights.symlink_to(out / "float-weights.safetensors")
    elif layout == "other-folder":
        (out / "photos").mkdir(parents=True)
        (out / "photos" / "cat.jpg").write_bytes(b"\xff\xd8 not a model")
    else:
        out.write_text("my notes\n")
    before = _tree(root)
    rc, err = _quantize(capsys, diffusers, calib, out)
    _one_line_error(rc, err)
    assert "--out" in err and ("contains" in err or "same file" in err or "not replaced" in err), \
        err
    assert _tree(root) == before  # nothing deleted, nothing written


def test_quantize_replaces_a_previous_quantised_model_with_the_umask_mode(work, tmp_path,
                                                                          capsys):
    """A previous output is replaced whole (the old marker file goes), the new folder gets the
    mode a plain mkdir gives under the umask (not mkdtemp's 0700), and no staging folder is
    left beside it."""
    out = tmp_path / "q"
    shutil.copytree(work / "fp8", out)
    (out / "old-marker").write_text("old")
    old_umask = os.umask(0o022)
    try:
        rc, err = _quantize(capsys, work / "float", work / "calib.pt", out, "--batches", "1")
    finally:
        os.umask(old_umask)
    assert rc == 0, err
    assert not (out / "old-marker").exists() and (out / quantization.MODELOPT_STATE_FILE).is_file()
    assert (out.stat().st_mode & 0o777) == 0o755
    assert all((p.stat().st_mode & 0o777) == 0o644 for p in out.iterdir() if p.is_file())
    assert [p.name for p in tmp_path.iterdir()] == ["q"]


def test_quantize_exclude_names_that_match_no_module_are_refused(work, tmp_path, capsys,
                                                                monkeypatch):
    """Refused before the weights are loaded (the module tree of config.json on the meta
    device), naming the unknown names and the top-level modules."""
    from qkrope.export import patch_diffusers

    def no_load(*a, **kw):
        raise AssertionError("the weights were loaded before --exclude was checked")

    monkeypatch.setattr(patch_diffusers, "load_transformer", no_load)
    rc, err = _quantize(capsys, work / "float", work / "calib.pt", tmp_path / "q",
                        "--exclude", "img_in", "proj_output", "transformer_blocks.7")
    _one_line_error(rc, err)
    assert "proj_output transformer_blocks.7" in err and "img_in," in err  # the available ones
    assert "proj_out" in err and not (tmp_path / "q").exists()
    monkeypatch.undo()
    model = load_transformer(str(work / "float"))
    quantize.check_exclude(model, ["transformer_blocks.0.attn", "transformer_blocks.*.img_mlp"])


@pytest.mark.parametrize("device, says", [("gpu", "not a torch device"),
                                          ("cuda:banana", "not a torch device"),
                                          ("meta", "no meta device"),
                                          ("cuda" if not torch.cuda.is_available() else "cuda:99",
                                           "cuda")])
def test_quantize_bad_device_is_one_line(work, tmp_path, capsys, device, says):
    rc = main(["quantize", "--diffusers", str(work / "float"), "--calibration",
               str(work / "calib.pt"), "--out", str(tmp_path / "q"), "--device", device])
    err = capsys.readouterr().err
    _one_line_error(rc, err)
    assert f"--device {device!r}" in err and says in err.lower() and "--device cpu" in err, err
    assert not (tmp_path / "q").exists()


class _RunsCode:
    """Unpickling this runs code (writes a marker file): a weights_only load must refuse it."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "code ran"))


def _calibration_cases(tmp_path, work):
    good = torch.load(work / "calib.pt", weights_only=True)
    nan = {**good, "batches": [dict(b) for b in good["batches"]]}
    hs = nan["batches"][1]["kwargs"]["hidden_states"].clone()
    hs[0, 3, 1] = float("nan")
    nan["batches"][1] = {"args": good["batches"][1]["args"],
                         "kwargs": {**good["batches"][1]["kwargs"], "hidden_states": hs}}
    wrong = {**good, "batches": [{"args": [], "kwargs": {
        **good["batches"][0]["kwargs"], "hidden_states": torch.randn(2, 16, 3)}}]}
    return {
        "batches-not-calls": ({"format": "qkrope-calibration", "batches": [1, 2]},
                              "batch 0 is not a recorded call"),
        "args-not-a-list": ({"format": "qkrope-calibration", "batches": [{"args": "x"}]},
                            "batch 0 is not a recorded call"),
        "batches-a-dict": ({"format": "qkrope-calibration", "batches": {"a": 1}},
                           "not a qkrope calibration file"),
        "nan": (nan, "batch 1 kwargs['hidden_states'] has 1 NaN"),
        "wrong-shapes": (wrong, "calibration batch 0 does not fit"),
        "pickled-code": (_RunsCode(tmp_path / "ran"), "weights_only=True refuses"),
    }


@pytest.mark.parametrize("case", ["batches-not-calls", "args-not-a-list", "batches-a-dict",
                                  "nan", "wrong-shapes", "pickled-code"])
def test_quantize_bad_calibration_files_are_one_line(work, tmp_path, capsys, monkeypatch, case):
    """A malformed, NaN-carrying, mismatched or code-carrying calibration file: one line naming
    the file or batch, no ModelOpt AssertionError, no code run (also with torch's
    TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD set), nothing written."""
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    data, says = _calibration_cases(tmp_path, work)[case]
    calib = tmp_path / "c.pt"
    torch.save(data, calib)
    rc, err = _quantize(capsys, work / "float", calib, tmp_path / "q")
    _one_line_error(rc, err)
    assert says in err and "weights_only=False" not in err, err
    assert not (tmp_path / "ran").exists() and not (tmp_path / "q").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.pt"]  # no staging folder


@pytest.mark.parametrize("case, says", [("pickled-code", "weights_only=True refuses"),
                                        ("truncated", "cannot be read"),
                                        ("not-modelopt", "is not ModelOpt's state"),
                                        ("no-version", "ModelOpt cannot restore it")])
def test_a_bad_modelopt_state_runs_no_code_and_is_one_line(work, tmp_path, capsys, monkeypatch,
                                                           case, says):
    """modelopt_state.pth is loaded with weights_only=True by qkrope (ModelOpt's own load
    follows torch's default, which TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD turns off): pickled code
    does not run, and every unusable state is one line naming the file."""
    monkeypatch.setenv("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", "1")
    q = tmp_path / "q"
    shutil.copytree(work / "fp8", q)
    state = q / quantization.MODELOPT_STATE_FILE
    if case == "pickled-code":
        torch.save({"modelopt_state_dict": _RunsCode(tmp_path / "ran")}, state)
    elif case == "truncated":
        state.write_bytes(state.read_bytes()[:200])
    elif case == "not-modelopt":
        torch.save({"x": torch.ones(1)}, state)
    else:
        good = torch.load(state, weights_only=True)
        torch.save({"modelopt_state_dict": good["modelopt_state_dict"]}, state)
    rc = main(["export", "--model", "transformer", "--diffusers", str(q), "--quant", "fp8",
               "--out", str(tmp_path / "m.onnx")])
    err = capsys.readouterr().err
    _one_line_error(rc, err)
    assert quantization.MODELOPT_STATE_FILE in err and says in err, err
    assert "weights_only=False" not in err and not (tmp_path / "ran").exists()


def test_a_full_disk_in_the_safetensors_write_keeps_the_old_folder(work, tmp_path, capsys,
                                                                   monkeypatch):
    """safetensors reports a full disk as SafetensorError (no OSError): one line naming the
    disk and --out, the old model intact, no staging folder."""
    import safetensors.torch
    from safetensors import SafetensorError

    def full(*a, **kw):
        raise SafetensorError("Error while serializing: I/O error: No space left on device "
                              "(os error 28)")

    out = tmp_path / "q"
    shutil.copytree(work / "fp8", out)
    before = _tree(out)
    monkeypatch.setattr(safetensors.torch, "save_file", full)
    rc, err = _quantize(capsys, work / "float", work / "calib.pt", out, "--batches", "1")
    _one_line_error(rc, err)
    assert "disk is full" in err and "--out" in err and str(out) in err, err
    assert _tree(out) == before and [p.name for p in tmp_path.iterdir()] == ["q"]


def test_quantize_checks_its_paths_before_importing_torch(tmp_path):
    code = textwrap.dedent(f"""
        import sys
        from qkrope.cli import main
        rc = main(["quantize", "--diffusers", {str(tmp_path / "missing")!r}, "--calibration",
                   {str(tmp_path / "c.pt")!r}, "--out", {str(tmp_path / "q")!r}])
        print(rc, "torch" in sys.modules)
    """)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert res.stdout.split() == ["2", "False"], (res.stdout, res.stderr)
    assert "--diffusers" in res.stderr and "does not exist" in res.stderr


_KILL_SCRIPT = textwrap.dedent("""
    import os, sys, time, types
    from pathlib import Path
    from qkrope import _fileio
    from qkrope.export import quantize
    out, where = sys.argv[1:3]
    # save_quantized as it runs, with a model whose save_pretrained writes two files (diffusers
    # and ModelOpt themselves are not what this checks, and their imports are slow)
    quantize._modelopt = lambda: (None, types.SimpleNamespace(
        modelopt_state=lambda m: {"modelopt_state_dict": [], "modelopt_version": "0"}))
    class Model:
        def save_pretrained(self, d):
            Path(d, "config.json").write_text('{"new": true}')
            Path(d, "diffusion_pytorch_model.safetensors").write_bytes(b"new" * 1000)
            if where == "in-save":
                print("paused", flush=True)
                time.sleep(60)
    if where == "between-renames":  # the two-rename fallback, paused after the first
        _fileio._exchange = lambda a, b: False
        real = os.rename
        def rename(a, b):
            real(a, b)
            if Path(b).name.endswith(".old"):
                print("paused", flush=True)
                time.sleep(60)
        os.rename = rename
    quantize.save_quantized(Model(), out)
    print("done", flush=True)
""")


@pytest.mark.skipif(os.name != "posix", reason="signals")
@pytest.mark.parametrize("sig, where", [(signal.SIGTERM, "in-save"),
                                        (signal.SIGKILL, "between-renames")])
def test_a_signal_mid_quantize_save_leaves_the_old_model(work, tmp_path, sig, where):
    """save_quantized in a subprocess, signalled for real. A SIGTERM while the new model is
    written: exit 143, the staging folder (a full copy of the model) removed, the old model in
    place. A real SIGKILL between the fallback
    commit's two renames (the old folder moved away, the new one not yet in): the next reader
    (qkrope's preflight of --diffusers) or writer puts the old folder back."""
    from qkrope import _preflight

    out = tmp_path / "q"
    shutil.copytree(work / "fp8", out)
    (out / "old-marker").write_text("old")
    before = _tree(out)
    proc = subprocess.Popen([sys.executable, "-c", _KILL_SCRIPT, str(out), where],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "paused"
        proc.send_signal(sig)
        rc = proc.wait(60)
    finally:
        proc.kill() if proc.poll() is None else None
    if sig == signal.SIGTERM:
        assert rc == 143 and _tree(out) == before
        assert [p.name for p in tmp_path.iterdir()] == ["q"]
        return
    assert rc == -signal.SIGKILL and not out.exists()  # the instant the fallback cannot avoid
    _preflight.input_dir(out, flag="--diffusers", fix="-")  # a reader finds it back
    assert _tree(out) == before
    _fileio.remove_stale_staging(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["q"]


def test_non_finite_weights_or_inputs_in_calibrate_are_one_line(work):
    """The API path (no load_calibration): a NaN input is named before ModelOpt runs; a weight
    that is inf makes ModelOpt assert, which becomes one QuantizeError naming the weights."""
    batches = quantize.load_calibration(work / "calib.pt")[:1]
    hs = batches[0]["kwargs"]["hidden_states"].clone()
    hs[0, 0, 0] = float("inf")
    bad = [{"args": (), "kwargs": {**batches[0]["kwargs"], "hidden_states": hs}}]
    model = load_transformer(str(work / "float"))
    with pytest.raises(quantization.InputError, match=r"batch 0 kwargs\['hidden_states'\] has 1"):
        quantize.calibrate(model, bad)
    with torch.no_grad():
        model.transformer_blocks[0].attn.to_q.weight[0, 0] = float("inf")
    with pytest.raises(quantize.QuantizeError, match="weights carry NaN/inf") as exc:
        quantize.calibrate(model, batches)
    assert "\n" not in str(exc.value)


def test_an_uncalibrated_layer_is_refused_only_where_the_graph_uses_it(work, tmp_path, capsys):
    """A quantizer the calibration never reached has no amax: its Linear belongs to a module the
    calibrated forward did not run. The export accepts it where the graph does not use that
    Linear either (here a block past --layers; FLUX.3's unserved reference-image stream) and
    lists it as not in the graph; where the graph uses it, it refuses in one line naming the
    quantizer and the weight, and writes nothing."""
    model = load_transformer(str(work / "fp8"), quant="fp8")
    owner = "transformer_blocks.1.attn.to_q"
    for role in ("input_quantizer", "weight_quantizer"):
        q = model.get_submodule(f"{owner}.{role}")
        q.reset_amax()
        assert q.is_enabled and getattr(q, "amax", None) is None
    quantize.save_quantized(model, tmp_path / "partly")
    assert main(["export", "--model", "transformer", "--diffusers", str(tmp_path / "partly"),
                 "--quant", "fp8", "--layers", "1", "--out", str(tmp_path / "l1.onnx")]) == 0
    record = ModelInfo.load(tmp_path / "l1.onnx").config.quantization
    assert owner in record["not_in_graph"] and owner not in record["quantized_linears"]
    capsys.readouterr()
    assert main(["export", "--model", "transformer", "--diffusers", str(tmp_path / "partly"),
                 "--quant", "fp8", "--out", str(tmp_path / "all.onnx")]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert (f"quantizer {owner}.input_quantizer is enabled but has no calibrated amax" in err
            and f"uses {owner}.weight" in err and "qkrope quantize" in err), err
    assert not (tmp_path / "all.onnx").exists()
