"""`qkrope check`: passes on a good model, fails (non-zero, clear) on perturbed weights; the
polygraphy files and command; the TensorRT side's missing-dependency message (CPU) and a
TensorRT run where TensorRT and CUDA exist; both sides compare through the runners
qkrope.runtime.load returns (the engine side over the fake TensorRT)."""

from __future__ import annotations

import os
import shutil
import subprocess

import numpy as np
import onnx
import pytest
import torch
from onnx import numpy_helper

from qkrope.cli import main
from qkrope.export.onnx_export import export_attention
from qkrope.apps import check as parity


def _has_trt_and_cuda() -> bool:
    try:
        import tensorrt  # noqa: F401
    except Exception:  # noqa: BLE001
        return False
    return torch.cuda.is_available()


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    out = tmp_path_factory.mktemp("check") / "attn.onnx"
    export_attention(out, heads=2, head_dim=64)
    return out


def test_check_passes(good, capsys, tmp_path):
    work = tmp_path / "work"
    assert main(["check", str(good), "--workdir", str(work)]) == 0
    out = capsys.readouterr().out
    assert "PASSED" in out and "img_out" in out and "txt_out" in out and "max abs" in out
    for name in ("inputs.json", "reference_outputs.json", "run_results.json", "polygraphy_cmd.sh"):
        assert (work / name).is_file()
    cmd = (work / "polygraphy_cmd.sh").read_text()
    assert "polygraphy run" in cmd and "--onnxrt" in cmd and "--load-outputs" in cmd


def test_polygraphy_command_reruns(good, tmp_path):
    work = tmp_path / "work"
    assert main(["check", str(good), "--workdir", str(work)]) == 0
    exe = shutil.which("polygraphy") or os.path.join(os.path.dirname(os.sys.executable),
                                                     "polygraphy")
    cmd = (work / "polygraphy_cmd.sh").read_text().splitlines()[1].replace("polygraphy", exe, 1)
    result = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]


def test_check_fails_on_perturbed_weights(good, tmp_path, capsys):
    model = onnx.load(str(good))
    target = next(t for t in model.graph.initializer if t.name.endswith("norm_q.weight"))
    arr = numpy_helper.to_array(target).copy()
    arr[::2] *= 1.5
    target.CopyFrom(numpy_helper.from_array(arr, target.name))
    bad = tmp_path / "bad.onnx"
    onnx.save(model, str(bad))
    # the sidecar of the source model, re-pointed at the edited file (it records its sha256)
    import json

    from qkrope._fileio import sha256_file

    side = json.loads(open(str(good) + ".json").read())
    side["model_sha256"] = sha256_file(bad)
    open(str(bad) + ".json", "w").write(json.dumps(side))
    assert main(["check", str(bad)]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "FAILED" in out


def test_check_without_sidecar(good, tmp_path, capsys):
    lone = tmp_path / "lone.onnx"
    shutil.copy(good, lone)
    assert main(["check", str(lone)]) == 2
    assert "qkrope export" in capsys.readouterr().err


def test_tolerances_scale_with_output():
    ref = {"a": np.full((4,), 3.0, np.float32)}
    atol, rtol = parity.tolerances("bf16", ref)["a"]
    assert atol == pytest.approx(2 * 2.0 ** (1 - 7)) and rtol == 2.0 ** -6   # 2 bf16 ulps at 3
    atol, _ = parity.tolerances("fp16", ref)["a"]
    assert atol == pytest.approx(2 * 2.0 ** (1 - 10))
    atol, rtol = parity.tolerances("fp32", ref)["a"]
    assert atol == pytest.approx(3e-5) and rtol == 1e-4
    row = parity.compare_arrays("a", ref["a"] + 0.05, ref["a"], 0.01, 0.01)
    assert not row.passed and row.max_abs == pytest.approx(0.05, rel=1e-3)


def test_qk_round_dtype_takes_the_coarser_tolerance():
    """A model that rounds its rotated q/k to a coarser dtype than the export's in every dtype
    (FamilyRecord.qk_round_dtype) is held to the coarser dtype's tolerance; a finer one changes
    nothing. Every record with the fact names a dtype the check has a tolerance for."""
    from qkrope import families

    ref = {"a": np.full((4,), 3.0, np.float32)}
    for model in ("attention", "transformer"):
        want = parity.tolerances("bf16", ref, model=model)
        assert parity.tolerances("fp32", ref, model=model, qk_round_dtype="bf16") == want
        assert parity.tolerances("fp16", ref, model=model, qk_round_dtype="bf16") == want
        assert parity.tolerances("bf16", ref, model=model, qk_round_dtype="fp16") == want
        assert parity.tolerances("fp32", ref, model=model, qk_round_dtype="fp16") \
            == parity.tolerances("fp16", ref, model=model)
        assert parity.tolerances("fp32", ref, model=model, qk_round_dtype=None) \
            == parity.tolerances("fp32", ref, model=model) != want
    assert parity.tolerance_dtype("fp32", "bf16") == "bf16"
    assert parity.tolerance_dtype("fp16", None) == "fp16"
    facts = {r.qk_round_dtype for r in families.records()} - {None}
    assert facts and facts <= set(parity.TOLERANCES)


@pytest.mark.skipif(_has_trt_and_cuda(), reason="TensorRT present: the missing-TRT path is moot")
def test_engine_without_tensorrt_is_one_clear_message(good, tmp_path, capsys):
    engine, plugin = tmp_path / "m.engine", tmp_path / "libqkrope.so"
    engine.write_bytes(b"x")
    plugin.write_bytes(b"x")
    assert main(["check", str(good), "--engine", str(engine), "--plugin", str(plugin)]) == 2
    err = capsys.readouterr().err
    assert "TensorRT" in err and ("NGC" in err or "nvcr.io" in err)


def test_arguments_checked_before_the_reference_runs(good, tmp_path, monkeypatch):
    """--no-onnxrt without --engine, a missing engine or plugin: rejected before the PyTorch
    reference (or any plugin loading) happens."""
    def no_reference(*a, **k):
        raise AssertionError("the reference was computed before the arguments were checked")

    monkeypatch.setattr(parity, "reference_outputs", no_reference)
    with pytest.raises(ValueError, match="--no-onnxrt leaves nothing to check"):
        parity.check_model(good, onnxrt=False)
    with pytest.raises(FileNotFoundError, match="--engine .* does not exist"):
        parity.check_model(good, engine=str(tmp_path / "none.engine"),
                           plugin=str(tmp_path / "none.so"))
    engine = tmp_path / "m.engine"
    engine.write_bytes(b"x")

    def no_trt(*a, **k):
        raise AssertionError("make_trt_runner (plugin dlopen) ran before the plugin was checked")

    monkeypatch.setattr(parity, "make_trt_runner", no_trt)
    with pytest.raises(FileNotFoundError, match="--plugin .* does not exist"):
        parity.check_model(good, engine=str(engine), plugin=str(tmp_path / "none.so"))


def test_trt_runner_loads_the_plugin_through_engine_module(tmp_path, monkeypatch):
    """One plugin loader: parity goes through qkrope.runtime.load, whose TensorRT loader uses
    loader_tensorrt.load_plugin_library, which also checks that the QKNormRoPE creator got
    registered."""
    import fake_tensorrt as ft

    from qkrope.runtime import loader_tensorrt as eng

    assert not hasattr(parity, "load_plugin_library")
    fake_trt, _ = ft.make_fake_trt("10.14.1", registered=False)
    monkeypatch.setitem(__import__("sys").modules, "tensorrt", fake_trt)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    loaded = []
    monkeypatch.setattr(eng.ctypes, "CDLL", lambda path, mode=0: loaded.append(path))
    engine, plugin = tmp_path / "m.engine", tmp_path / "libother.so"
    engine.write_bytes(b"x")
    plugin.write_bytes(b"x")
    with pytest.raises(eng.EngineBuildError, match="no creator 'QKNormRoPE'"):
        parity.make_trt_runner(str(engine), str(plugin))
    assert loaded == [str(plugin.resolve())]


def test_engine_needs_plugin(good, capsys):
    assert main(["check", str(good), "--engine", "m.engine"]) == 2
    assert "--plugin" in capsys.readouterr().err


@pytest.mark.skipif(not _has_trt_and_cuda(), reason="requires TensorRT and CUDA")
def test_tensorrt_parity(good, tmp_path, capsys):
    """Build the plugin and an engine, then TensorRT vs ONNX Runtime vs PyTorch."""
    plugin = os.environ.get("QKROPE_PLUGIN")
    if not plugin or not os.path.isfile(plugin):
        pytest.skip("set QKROPE_PLUGIN to the built plugin library (qkrope build-plugin)")
    engine = tmp_path / "attn.engine"
    assert main(["build", str(good), "-o", str(engine), "--plugin", plugin]) == 0
    assert main(["check", str(good), "--engine", str(engine), "--plugin", plugin]) == 0
    out = capsys.readouterr().out
    assert "tensorrt" in out and "PASSED" in out


# --------------------------------------------------------------------------------------------
# The node contract, unreadable files and bad sidecars: one line, before anything runs
# --------------------------------------------------------------------------------------------

from _bad_nodes import BAD_NODE_CASES, BROKEN_FILES, write_bad_copy  # noqa: E402
from _bad_nodes import write_broken_copy  # noqa: E402


@pytest.fixture
def nothing_runs(monkeypatch):
    """No runner or reference may start."""
    def refuse(*a, **k):
        raise AssertionError("a runner or the reference started before the model was checked")

    monkeypatch.setattr(parity, "make_ort_runner", refuse)
    monkeypatch.setattr(parity, "reference_outputs", refuse)


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("case", list(BAD_NODE_CASES))
def test_check_refuses_nodes_that_break_the_contract(good, tmp_path, capsys, nothing_runs, case):
    bad, attribute, node = write_bad_copy(good, tmp_path / "bad.onnx", case)
    assert main(["check", str(bad)]) == 2
    err = _one_line_error(capsys)
    assert attribute in err and node in err


@pytest.mark.parametrize("case", list(BROKEN_FILES))
def test_check_unreadable_onnx_is_one_line(good, tmp_path, capsys, nothing_runs, case):
    bad = write_broken_copy(good, tmp_path / "broken.onnx", case)
    assert main(["check", str(bad)]) == 2
    assert "not a readable ONNX model" in _one_line_error(capsys)


@pytest.mark.parametrize("sidecar", ["[]", '{"format": "qkrope-onnx", "format_version": 1, '
                                           '"inputs": 5}', '"just a string"'])
def test_check_wrong_shape_sidecar_is_one_line(good, tmp_path, capsys, nothing_runs, sidecar):
    path = tmp_path / "m.onnx"
    shutil.copy(good, path)
    (tmp_path / "m.onnx.json").write_text(sidecar)
    assert main(["check", str(path)]) == 2
    assert "m.onnx.json" in _one_line_error(capsys)


def test_engine_that_is_an_onnx_model_is_refused_first(good, tmp_path, capsys, nothing_runs):
    plugin = tmp_path / "lib.so"
    plugin.write_bytes(b"x")
    assert main(["check", str(good), "--engine", str(good), "--plugin", str(plugin)]) == 2
    assert "not a TensorRT engine" in _one_line_error(capsys)


# --------------------------------------------------------------------------------------------
# The comparison goes through the runners users call (qkrope.runtime.load), behind polygraphy's
# runner interface
# --------------------------------------------------------------------------------------------

def test_onnxrt_side_is_the_runtime_runner(good, tmp_path, monkeypatch):
    """`qkrope check` runs the model through qkrope's own OrtRunner (its checks included),
    not a runner of polygraphy's."""
    from qkrope.runtime import runner_onnxrt

    calls = []
    real = runner_onnxrt.OrtRunner.__call__

    def spy(self, *a, **k):
        calls.append(self.backend)
        return real(self, *a, **k)

    monkeypatch.setattr(runner_onnxrt.OrtRunner, "__call__", spy)
    passed, rows = parity.check_model(good, workdir=tmp_path / "work")
    assert passed and calls == ["onnxruntime"]
    assert {r.runner for r in rows} == {"onnxrt"}


def test_engine_side_is_the_runtime_runner_over_a_fake_tensorrt(tmp_path, monkeypatch):
    """--engine: make_trt_runner gives polygraphy a runner over what qkrope.runtime.load returns
    for the engine (the loader deserialises it with the plugin loaded, TensorRTRunner runs it);
    the feeds reach the runner's arguments by role and its outputs come back by name."""
    import fake_tensorrt as ft
    import numpy as np
    from _runner_helpers import (FakeCuda, _engine_sidecar, _multi_engine, _profile,
                                 _qwen_inputs)

    from qkrope.runtime import loader_tensorrt, runner_tensorrt

    trt, state = ft.make_fake_trt("10.14.1")
    engine = _multi_engine([_profile((1, 2), 16, 8)])
    state.engines[b"FAKE-ENGINE"] = engine
    monkeypatch.setitem(__import__("sys").modules, "tensorrt", trt)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    loaded = []
    monkeypatch.setattr(loader_tensorrt.ctypes, "CDLL", lambda path, mode=0: loaded.append(path))
    path, plugin = tmp_path / "m.engine", tmp_path / "libqkrope_plugin.so"
    path.write_bytes(b"FAKE-ENGINE")
    plugin.write_bytes(b"x")
    sidecar = _engine_sidecar()
    monkeypatch.setattr(loader_tensorrt.EngineInfo, "load", lambda p: sidecar)
    monkeypatch.setattr(loader_tensorrt, "engine_sidecar_path", lambda p: path)  # "exists"

    adapter = parity.make_trt_runner(str(path), str(plugin))
    assert loaded == [str(plugin.resolve())]
    assert isinstance(adapter.runner, runner_tensorrt.TensorRTRunner)
    assert adapter.runner.engine is engine and adapter.name == "trt-runner"
    # no GPU here: the runner's CUDA calls go to the stand-in, its tensors stay on the CPU
    adapter.runner.device, adapter.runner.cuda = torch.device("cpu"), FakeCuda()
    adapter.runner._check_device = lambda device: None
    hs, ehs, (img, txt) = _qwen_inputs(2, 4, 5)
    feeds = {"hidden_states": hs.numpy(), "encoder_hidden_states": ehs.numpy(),
             "encoder_hidden_states_mask": np.ones((2, 5), bool),
             "img_cos_sin_cache": img.numpy(), "txt_cos_sin_cache": txt.numpy()}
    with adapter:
        meta = adapter.get_input_metadata(use_numpy_dtypes=False)
        assert list(meta) == list(feeds)
        outs = adapter.infer(feeds)
        assert set(outs) == {"img_out", "txt_out"} and outs["img_out"].shape == hs.shape
        assert outs["txt_out"].dtype == np.float32
        assert [c[0] for c in engine.calls].count("execute_async_v3") == 1
        # the runner's own checks run: a short cache is refused before TensorRT executes
        from qkrope.runtime import RopeCacheOverflowError

        with pytest.raises(RopeCacheOverflowError):
            adapter.infer({**feeds, "img_cos_sin_cache": img[:4].contiguous().numpy()})
        assert [c[0] for c in engine.calls].count("execute_async_v3") == 1


def test_a_bf16_export_on_the_cpu_provider_is_refused_from_its_sidecar(tmp_path, capsys,
                                                                       nothing_runs,
                                                                       monkeypatch):
    """Issue 35 item 1: ONNX Runtime's CPU provider has no bfloat16 MatMul kernel. A bf16
    export checked on it alone is refused in one line from its sidecar, before the model is
    hashed or a session made (at the real width a minute and gigabytes); with --providers cuda
    or --no-onnxrt the refusal does not apply."""
    from qkrope.sidecars import ModelInfo

    model = tmp_path / "attn_bf16.onnx"
    export_attention(model, heads=2, head_dim=64, dtype="bf16")
    hashed = []
    load = ModelInfo.load.__func__

    def spy(cls, path, *, full=None):
        hashed.append(full)
        return load(cls, path, full=full)

    monkeypatch.setattr(ModelInfo, "load", classmethod(spy))
    assert main(["check", str(model), "--workdir", str(tmp_path / "w")]) == 2
    err = _one_line_error(capsys)
    assert "bf16 export" in err and "--providers cuda" in err and "--no-onnxrt" in err
    assert True not in hashed and not (tmp_path / "w").exists()
    # the refusal is the CPU provider's only
    assert parity._refuse_bf16_on_cpu(str(model), ["cuda"], True) is None
    assert parity._refuse_bf16_on_cpu(str(model), ["cpu"], False) is None
