"""The runtime wrapper (`qkrope.runtime.load`) on the ONNX Runtime backend: parity with the eager
QwenImageAttention, every bad input rejected before anything executes, output buffer reuse,
threads, bf16 binding, and the TensorRT backend's missing-dependency message.
"""

from __future__ import annotations

import json
import sys
import threading
from pathlib import Path

import fake_tensorrt as ft
import pytest
import torch

from qkrope._deps import MissingDependencyError
from qkrope.runtime import RopeCacheError, RopeCacheOverflowError, build_qwen_rope_caches
from qkrope.runtime import runner as rn
from qkrope.sidecars import ModelInfo

HEADS, HEAD_DIM = 2, 16
C = HEADS * HEAD_DIM
IMG_SHAPES = [(1, 4, 4)]
S_IMG, S_TXT = 16, 5


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    from qkrope.export.onnx_export import build_attention, export_attention

    path = tmp_path_factory.mktemp("runner") / "attn.onnx"
    info, _ = export_attention(path, heads=HEADS, head_dim=HEAD_DIM, img_shapes=IMG_SHAPES,
                               txt_len=S_TXT, batch=2)
    return path, build_attention(ModelInfo.load(path))


class SpySession:
    """Delegates to the ORT session and counts executions."""

    def __init__(self, session):
        self._s = session
        self.calls = 0

    def run_with_iobinding(self, *a, **k):
        self.calls += 1
        return self._s.run_with_iobinding(*a, **k)

    def run(self, *a, **k):  # pragma: no cover - the runner uses IOBinding
        self.calls += 1
        return self._s.run(*a, **k)

    def __getattr__(self, name):
        return getattr(self._s, name)


@pytest.fixture(scope="module")
def runner(exported):
    r = rn.load(exported[0])
    r.session = SpySession(r.session)
    return r


def inputs(batch=2, s_img=S_IMG, s_txt=S_TXT, img_shapes=IMG_SHAPES, seed=0, extra_rows=0,
           axes_dim=(2, 6, 8)):
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(batch, s_img, C, generator=g)
    ehs = torch.randn(batch, s_txt, C, generator=g)
    caches = build_qwen_rope_caches(img_shapes, s_txt + extra_rows, axes_dim=axes_dim)
    return hs, ehs, (caches.img, caches.txt)


# --------------------------------------------------------------------------------------------
# Parity
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("batch,img_shapes,s_txt,masked", [
    (2, [(1, 4, 4)], 5, False),
    (1, [(1, 2, 3)], 7, True),
    (3, [(1, 4, 4), (1, 2, 2)], 4, True),
])
def test_ort_parity_with_eager(runner, exported, batch, img_shapes, s_txt, masked):
    module = exported[1]
    s_img = sum(f * h * w for f, h, w in img_shapes)
    hs, ehs, caches = inputs(batch, s_img, s_txt, img_shapes)
    mask = None
    if masked:
        mask = torch.ones(batch, s_txt, dtype=torch.bool)
        mask[0, -2:] = False
    with torch.no_grad():
        ref_img, ref_txt = module(hs, ehs, caches, mask)
    img, txt = runner(hs, ehs, caches, mask)
    assert img.shape == (batch, s_img, C) and txt.shape == (batch, s_txt, C)
    torch.testing.assert_close(img, ref_img, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(txt, ref_txt, atol=2e-5, rtol=1e-4)


def test_run_qwen_builds_caches_and_matches(runner, exported):
    hs, ehs, caches = inputs()
    with torch.no_grad():
        ref_img, ref_txt = exported[1](hs, ehs, caches)
    img, txt = runner.run_qwen(hs, ehs, img_shapes=IMG_SHAPES)
    torch.testing.assert_close(img, ref_img, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(txt, ref_txt, atol=2e-5, rtol=1e-4)
    # caches with more rows than tokens are allowed (rows past the tokens are unused)
    img2, _ = runner(hs, ehs, inputs(extra_rows=3)[2])
    torch.testing.assert_close(img2, ref_img, atol=2e-5, rtol=1e-4)
    with pytest.raises(rn.RunnerInputError, match="give 12 image tokens but hidden_states has 16"):
        runner.run_qwen(hs, ehs, img_shapes=[(1, 3, 4)])


def test_outputs_allocated_once_per_shape(exported):
    r = rn.load(exported[0])
    hs, ehs, caches = inputs()
    a_img, _ = r(hs, ehs, caches)
    ptr = a_img.data_ptr()
    b_img, _ = r(hs * 2, ehs, caches)
    assert b_img.data_ptr() == ptr  # same buffer, overwritten
    c_img, _ = r(*inputs(batch=1)[:2], caches)
    assert c_img.data_ptr() != ptr and c_img.shape[0] == 1
    d_img, _ = r(hs, ehs, caches)
    assert d_img.data_ptr() == ptr  # the batch-2 buffer is still cached
    keep = rn.load(exported[0], copy_outputs=True)
    e_img, _ = keep(hs, ehs, caches)
    f_img, _ = keep(hs, ehs, caches)
    assert e_img.data_ptr() != f_img.data_ptr()


def test_threads_get_their_own_buffers(runner, exported):
    results, errors = {}, []

    def work(seed):
        try:
            hs, ehs, caches = inputs(seed=seed)
            for _ in range(3):
                img, _ = runner(hs, ehs, caches)
            with torch.no_grad():
                ref, _ = exported[1](hs, ehs, caches)
            results[seed] = (img.clone(), ref)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in (1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    for img, ref in results.values():
        torch.testing.assert_close(img, ref, atol=2e-5, rtol=1e-4)


# --------------------------------------------------------------------------------------------
# Bad inputs: rejected before anything executes
# --------------------------------------------------------------------------------------------

def _bad_cases():
    hs, ehs, (img, txt) = inputs()
    cases = {}
    cos, sin = img[:, :8], img[:, 8:]
    tcos, tsin = txt[:, :8], txt[:, 8:]
    cases["diffusers 4-tuple"] = (
        dict(image_rotary_emb=(cos, sin, tcos, tsin)), RopeCacheError,
        r"image_rotary_emb must be cos_sin_cache tensors.*4 tensors.*to_cos_sin_caches")
    cases["complex pair"] = (
        dict(image_rotary_emb=(torch.polar(torch.ones(16, 8), torch.zeros(16, 8)),
                               torch.polar(torch.ones(5, 8), torch.zeros(5, 8)))),
        RopeCacheError, r"image_rotary_emb must be cos_sin_cache tensors.*to_cos_sin_caches")
    cases["nested (cos, sin) pairs"] = (
        dict(image_rotary_emb=((cos, sin), (tcos, tsin))), RopeCacheError,
        "image_rotary_emb must be cos_sin_cache tensors")
    cases["single tensor"] = (dict(image_rotary_emb=img), RopeCacheError,
                              "image_rotary_emb must be cos_sin_cache tensors")
    cases["cache dtype"] = (dict(image_rotary_emb=(img.half(), txt)), RopeCacheError,
                            "img cos_sin_cache must be float32")
    cases["rows overflow"] = (dict(image_rotary_emb=(img[:10], txt)), RopeCacheOverflowError,
                              "required=16, available=10, overflow=6")
    cases["txt rows overflow"] = (dict(image_rotary_emb=(img, txt[:2])), RopeCacheOverflowError,
                                  "txt cos_sin_cache has too few rows")
    cases["width > head_dim"] = (dict(image_rotary_emb=(torch.zeros(16, 18), txt)),
                                 RopeCacheError, "width .* must be even")
    cases["width != model's rotary_dim"] = (
        dict(image_rotary_emb=(img[:, :8].contiguous(), txt)), rn.RunnerInputError,
        r"img_cache \(model input 'img_cos_sin_cache'\) has shape \(16, 8\): dimension 1 is 8, "
        r"the model's is 16")
    cases["cache device"] = (dict(image_rotary_emb=(img.to("meta"), txt)), RopeCacheError,
                             "is on meta but the activations are on cpu")
    cases["cache non-contiguous"] = (
        dict(image_rotary_emb=(torch.zeros(16, 32)[:, ::2], txt)), RopeCacheError,
        "must be contiguous")
    cases["hidden size"] = (dict(hidden_states=torch.randn(2, 16, 64)), rn.RunnerInputError,
                            "hidden size is 64, the model's is 32")
    cases["encoder hidden size"] = (dict(encoder_hidden_states=torch.randn(2, 5, 16)),
                                    rn.RunnerInputError, "hidden size is 16, the model's is 32")
    cases["hidden dtype"] = (dict(hidden_states=hs.bfloat16()), rn.RunnerInputError,
                             r"has dtype bfloat16; the model expects float32.*\.to\(torch.float32\)")
    cases["hidden rank"] = (dict(hidden_states=hs[0]), rn.RunnerInputError, "must be 3-D")
    cases["hidden not a tensor"] = (dict(hidden_states=hs.numpy()), rn.RunnerInputError,
                                    "must be a torch.Tensor")
    cases["hidden non-contiguous"] = (dict(hidden_states=hs.transpose(0, 1).contiguous()
                                           .transpose(0, 1)), rn.RunnerInputError,
                                      "must be contiguous")
    cases["hidden device"] = (dict(hidden_states=hs.to("meta"), encoder_hidden_states=ehs.to("meta"),
                                   image_rotary_emb=(img.to("meta"), txt.to("meta"))),
                              rn.RunnerInputError, "the inputs are on meta; this runner takes cpu or cuda")
    cases["batch mismatch"] = (dict(encoder_hidden_states=torch.randn(1, 5, C)),
                               rn.RunnerInputError, "batch mismatch: hidden_states has batch 2")
    cases["mask shape"] = (dict(encoder_hidden_states_mask=torch.ones(2, 4, dtype=torch.bool)),
                           rn.RunnerInputError,
                           r"encoder_hidden_states_mask must be \[batch, txt_tokens\] = \(2, 5\)")
    cases["mask dtype"] = (dict(encoder_hidden_states_mask=torch.ones(2, 5)), rn.RunnerInputError,
                           "expects bool .*mask > 0")
    cases["mask device"] = (dict(encoder_hidden_states_mask=torch.ones(2, 5, dtype=torch.bool,
                                                                       device="meta")),
                            rn.RunnerInputError, "is on meta but hidden_states is on cpu")
    cases["timestep on an attention block"] = (dict(timestep=torch.ones(2)), rn.RunnerInputError,
                                               "no timestep input")
    cases["unknown extra input"] = (dict(extra_inputs={"bogus": torch.ones(1)}),
                                    rn.RunnerInputError, "unknown input")
    # extra_inputs must not replace an input the runner already validated (a short cache passed
    # this way used to reach ONNX Runtime and run)
    cases["extra_inputs replaces the image cache"] = (
        dict(extra_inputs={"img_cos_sin_cache": img[:4].contiguous()}), rn.RunnerInputError,
        r"extra_inputs names 'img_cos_sin_cache', which is the model's img_cache input.*"
        r"image_rotary_emb=")
    cases["extra_inputs replaces hidden_states"] = (
        dict(extra_inputs={"hidden_states": hs.clone()}), rn.RunnerInputError,
        "extra_inputs names 'hidden_states'.*hidden_states=")
    cases["extra_inputs replaces the default mask"] = (
        dict(extra_inputs={"encoder_hidden_states_mask": torch.ones(2, 5, dtype=torch.bool)}),
        rn.RunnerInputError, "encoder_hidden_states_mask=")
    return cases


BAD = _bad_cases()


@pytest.mark.parametrize("case", list(BAD))
def test_bad_input_rejected_before_execution(runner, case):
    overrides, exc_type, pattern = BAD[case]
    hs, ehs, caches = inputs()
    kwargs = dict(hidden_states=hs, encoder_hidden_states=ehs, image_rotary_emb=caches)
    kwargs.update(overrides)
    before = runner.session.calls
    with pytest.raises(exc_type, match=pattern) as info:
        runner(**kwargs)
    assert runner.session.calls == before, "the model ran despite a failed check"
    assert isinstance(info.value, RuntimeError)
    assert "Fix" in str(info.value)


def test_check_inputs_rejects_short_caches_whatever_the_path(runner):
    """check_inputs itself (not only the cache validation in prepare) needs cache rows >= the
    tokens of the cache's stream."""
    hs, ehs, (img, txt) = inputs()
    roles = runner.io.roles
    good = {roles["hidden_states"]: hs, roles["encoder_hidden_states"]: ehs,
            roles["encoder_hidden_states_mask"]: torch.ones(2, S_TXT, dtype=torch.bool),
            roles["img_cache"]: img, roles["txt_cache"]: txt}
    rn.check_inputs(runner.io, good, device=torch.device("cpu"))
    with pytest.raises(rn.RunnerInputError, match=r"img_cache .* has 10 rows but hidden_states "
                                                  r"has 16 image tokens.*one row per token"):
        rn.check_inputs(runner.io, {**good, roles["img_cache"]: img[:10].contiguous()},
                        device=torch.device("cpu"))
    with pytest.raises(rn.RunnerInputError, match=r"txt_cache .* has 3 rows but "
                                                  r"encoder_hidden_states has 5 text tokens"):
        rn.check_inputs(runner.io, {**good, roles["txt_cache"]: txt[:3].contiguous()},
                        device=torch.device("cpu"))
    # more rows than tokens is fine (a cache built for the longest prompt)
    longer = build_qwen_rope_caches(IMG_SHAPES, S_TXT + 3, axes_dim=(2, 6, 8)).txt
    rn.check_inputs(runner.io, {**good, roles["txt_cache"]: longer}, device=torch.device("cpu"))


def test_check_roles_takes_no_timestep():
    import inspect

    assert list(inspect.signature(rn.check_roles).parameters) == [
        "hidden_states", "encoder_hidden_states", "mask"]


def test_bf16_unresolvable_output_rejected_before_execution(tmp_path):
    """A bf16 output whose shape does not follow from the inputs' named axes cannot be read back:
    that is known before anything runs, so the session must not run."""
    r = rn.load(_write_bf16_identity_model(tmp_path / "bf16.onnx"))
    spec = r.io.outputs[0]
    r.io.outputs[0] = rn.TensorSpec(spec.name, spec.dtype, spec.dims,
                                    ("mystery_axis",) + spec.axes[1:])
    r.session = SpySession(r.session)
    hs, ehs, caches = inputs()
    with pytest.raises(rn.RunnerError, match="cannot bind the bfloat16 output img_out"):
        r(hs.bfloat16(), ehs.bfloat16(), caches)
    assert r.session.calls == 0, "ONNX Runtime ran before the unresolvable output was reported"


def test_errors_are_runtime_and_value_errors():
    assert issubclass(rn.RunnerInputError, RuntimeError)
    assert issubclass(rn.RunnerInputError, ValueError)


# --------------------------------------------------------------------------------------------
# bf16 through IOBinding (numpy has no bfloat16): a graph ORT's CPU provider can run in bf16
# --------------------------------------------------------------------------------------------

def _write_bf16_identity_model(path: Path) -> Path:
    import onnx
    from onnx import TensorProto, helper

    bf, f32, b = TensorProto.BFLOAT16, TensorProto.FLOAT, TensorProto.BOOL
    ins = [helper.make_tensor_value_info("hidden_states", bf, ["batch", "img_tokens", C]),
           helper.make_tensor_value_info("encoder_hidden_states", bf, ["batch", "txt_tokens", C]),
           helper.make_tensor_value_info("encoder_hidden_states_mask", b, ["batch", "txt_tokens"]),
           helper.make_tensor_value_info("img_cos_sin_cache", f32, ["img_cache_rows", HEAD_DIM]),
           helper.make_tensor_value_info("txt_cos_sin_cache", f32, ["txt_cache_rows", HEAD_DIM])]
    outs = [helper.make_tensor_value_info("img_out", bf, ["batch", "img_tokens", C]),
            helper.make_tensor_value_info("txt_out", bf, ["batch", "txt_tokens", C])]
    nodes = [helper.make_node("Identity", ["hidden_states"], ["img_out"]),
             helper.make_node("Identity", ["encoder_hidden_states"], ["txt_out"])]
    model = helper.make_model(helper.make_graph(nodes, "bf16_identity", ins, outs),
                              opset_imports=[helper.make_opsetid("", 18)], ir_version=10)
    onnx.save(model, str(path))
    Path(str(path) + ".json").write_text(json.dumps({
        "format": "qkrope-onnx", "format_version": 1, "model": "attention", "opset": 18,
        "ir_version": 10,
        "dtype": "bf16", "dynamic_axes": {}, "node_attributes": {},
        "sample": {"img_shapes": [list(IMG_SHAPES[0])], "txt_len": S_TXT, "batch": 2},
        "inputs": [{"name": i.name, "dtype": d, "shape": s} for i, d, s in zip(
            ins, ["bfloat16", "bfloat16", "bool", "float32", "float32"],
            [["batch", "img_tokens", C], ["batch", "txt_tokens", C], ["batch", "txt_tokens"],
             ["img_cache_rows", HEAD_DIM], ["txt_cache_rows", HEAD_DIM]])],
        "outputs": [{"name": "img_out", "dtype": "bfloat16", "shape": ["batch", "img_tokens", C]},
                    {"name": "txt_out", "dtype": "bfloat16", "shape": ["batch", "txt_tokens", C]}],
        "config": {"head_dim": HEAD_DIM, "axes_dims_rope": [2, 6, 8]}}))
    return path


def test_bf16_zero_copy_binding(tmp_path):
    r = rn.load(_write_bf16_identity_model(tmp_path / "bf16.onnx"))
    hs, ehs, caches = inputs()
    hs, ehs = hs.bfloat16(), ehs.bfloat16()
    img, txt = r(hs, ehs, caches)
    assert img.dtype == torch.bfloat16
    assert torch.equal(img, hs) and torch.equal(txt, ehs)  # bit-exact: no conversion anywhere
    with pytest.raises(rn.RunnerInputError, match="has dtype float32; the model expects bfloat16"):
        r(hs.float(), ehs, caches)


# --------------------------------------------------------------------------------------------
# load(): suffixes, missing TensorRT
# --------------------------------------------------------------------------------------------

def test_load_dispatch_errors(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError):
        rn.load(tmp_path / "nope.onnx")
    odd = tmp_path / "model.bin"
    odd.write_bytes(b"x")
    with pytest.raises(rn.RunnerError, match=r"\.engine or \.plan"):
        rn.load(odd)
    eng_file = tmp_path / "model.engine"
    eng_file.write_bytes(b"not an engine")
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    with pytest.raises(MissingDependencyError, match="NGC TensorRT container"):
        rn.load(eng_file)


def test_load_is_exported_from_runtime():
    import qkrope.runtime as rt

    assert rt.load is rn.load
    assert rt.RunnerInputError is rn.RunnerInputError


def test_bf16_model_on_cpu_provider_gets_clear_error(tmp_path, monkeypatch):
    import onnxruntime as ort

    class NoKernel:
        def __init__(self, *a, **k):
            raise RuntimeError("[ONNXRuntimeError] : 9 : NOT_IMPLEMENTED : Could not find an "
                               "implementation for MatMul(13) node with name 'node_MatMul_8'")

    f = _write_bf16_identity_model(tmp_path / "m.onnx")
    monkeypatch.setattr(ort, "InferenceSession", NoKernel)
    with pytest.raises(rn.RunnerError, match="no bfloat16 MatMul.*CUDAExecutionProvider"):
        rn.load(f)


# --------------------------------------------------------------------------------------------
# TensorRT engine I/O -> checks against the profile (fake engine; no TensorRT needed)
# --------------------------------------------------------------------------------------------

def fake_engine(max_img=64, max_txt=8, max_batch=2) -> ft.ICudaEngine:
    """The ICudaEngine calls engine_model_io makes, for the tiny attention block."""
    d = [("hidden_states", "FLOAT", [-1, -1, C], [(1, 1, C), (2, 16, C), (max_batch, max_img, C)]),
         ("encoder_hidden_states", "FLOAT", [-1, -1, C],
          [(1, 1, C), (2, 5, C), (max_batch, max_txt, C)]),
         ("encoder_hidden_states_mask", "BOOL", [-1, -1], [(1, 1), (2, 5), (max_batch, max_txt)]),
         ("img_cos_sin_cache", "FLOAT", [-1, HEAD_DIM],
          [(1, HEAD_DIM), (16, HEAD_DIM), (max_img, HEAD_DIM)]),
         ("txt_cos_sin_cache", "FLOAT", [-1, HEAD_DIM],
          [(1, HEAD_DIM), (5, HEAD_DIM), (max_txt, HEAD_DIM)])]
    io = [(n, t, s, p, ft.TensorIOMode.INPUT) for n, t, s, p in d]
    io += [("img_out", "FLOAT", [-1, -1, C], None, ft.TensorIOMode.OUTPUT),
           ("txt_out", "FLOAT", [-1, -1, C], None, ft.TensorIOMode.OUTPUT)]
    return ft.ICudaEngine(io)


class RecordingRunner(rn.Runner):
    backend = "fake"

    def __init__(self, io):
        super().__init__(io)
        self.executed = 0

    def _check_device(self, device):
        pass

    def _execute(self, feeds, axes, device):
        self.executed += 1
        return [torch.zeros(1), torch.zeros(1)]


def test_engine_io_and_profile_bounds():
    trt, _ = ft.make_fake_trt()
    from qkrope.sidecars import EngineInfo, EngineTensor

    axes = {"hidden_states": ["batch", "img_tokens", None],
            "encoder_hidden_states": ["batch", "txt_tokens", None],
            "encoder_hidden_states_mask": ["batch", "txt_tokens"],
            "img_cos_sin_cache": ["img_cache_rows", None],
            "txt_cos_sin_cache": ["txt_cache_rows", None]}
    side = EngineInfo(
        tensorrt_version="10.14", onnx="/m.onnx",
        inputs=[EngineTensor(n, "float32", [-1] * len(a), a) for n, a in axes.items()],
        outputs=[], profiles=[], plugin=None, plugin_layers=2, version_compatible=False,
        strongly_typed=True, config={"head_dim": HEAD_DIM, "axes_dims_rope": [2, 6, 8]})
    io = rn.engine_model_io(fake_engine(), trt, side)
    assert io.head_dim == HEAD_DIM
    assert io.roles["img_cache"] == "img_cos_sin_cache"
    assert io.input("hidden_states").dims == ((1, 2), (1, 64), (C, C))
    assert io.input("hidden_states").axes == ("batch", "img_tokens", None)
    r = RecordingRunner(io)
    hs, ehs, caches = inputs()
    r(hs, ehs, caches)
    assert r.executed == 1
    r.run_qwen(hs, ehs, img_shapes=IMG_SHAPES)
    assert r.executed == 2
    # beyond the profile: text tokens 9 > max 8, batch 3 > 2, cache rows 80 > 64
    with pytest.raises(rn.RunnerInputError, match=r"txt_tokens\) = 9 is outside the range 1..8.*"
                                                  r"--max-txt-tokens"):
        r(*inputs(s_txt=9))
    with pytest.raises(rn.RunnerInputError, match=r"dimension 0 \(batch\) = 3 is outside"):
        r(*inputs(batch=3))
    big = build_qwen_rope_caches([(1, 8, 10)], 5, axes_dim=(2, 6, 8))
    with pytest.raises(rn.RunnerInputError, match=r"img_cache_rows\) = 80 is outside the range"):
        r(hs, ehs, (big.img, caches[1]))
    assert r.executed == 2


def test_plugin_resolution_is_one_function(tmp_path, monkeypatch):
    """engine (qkrope build), runner and triton all resolve the plugin with
    plugin_build.resolve_plugin_library: explicit, else the sidecar's path if it exists, else
    the built library; the hash check is one of its options."""
    import inspect

    from qkrope.runtime import engine as eng
    from qkrope.runtime import plugin_build as pb
    from qkrope.runtime import triton
    from qkrope.sidecars import PluginRecord

    built = tmp_path / "build" / "libqkrope_plugin.so"
    built.parent.mkdir()
    built.write_bytes(b"built")
    monkeypatch.setenv("QKROPE_PLUGIN_LIB", str(built))
    recorded = tmp_path / "recorded.so"
    recorded.write_bytes(b"recorded")
    record = PluginRecord(str(recorded), None)
    assert pb.resolve_plugin_library(None, record) == recorded.resolve()
    assert pb.resolve_plugin_library(None, PluginRecord(str(tmp_path / "gone.so"))) == \
        built.resolve()
    assert pb.resolve_plugin_library(None, None) == built.resolve()
    assert pb.resolve_plugin_library(built, record) == built.resolve()
    with pytest.raises(FileNotFoundError, match="qkrope build-plugin"):
        pb.resolve_plugin_library(tmp_path / "missing.so", record)
    assert pb.resolve_plugin_library(recorded, PluginRecord(str(recorded), None),
                                     check_hash="error") == recorded.resolve()
    with pytest.raises(pb.PluginMismatchError):
        pb.resolve_plugin_library(recorded, PluginRecord(str(recorded), "0" * 64),
                                  check_hash="error")
    # the callers use it (no private copies or other spellings left)
    assert not hasattr(eng, "resolve_plugin_library") or \
        eng.resolve_plugin_library is pb.resolve_plugin_library
    for gone in ((pb, "plugin_record"), (pb, "plugin_sha256_mismatch"), (pb, "add_cli"),
                 (triton, "resolve_plugin"), (rn, "resolve_runtime_plugin")):
        assert not hasattr(*gone), gone
    for mod in (rn, triton):
        assert "resolve_plugin_library(" in inspect.getsource(mod)


def test_runtime_plugin_resolution(tmp_path):
    """The runner's use: the engine's recorded library, a warning for a different one."""
    from qkrope._fileio import sha256_file
    from qkrope.runtime.plugin_build import resolve_plugin_library
    from qkrope.sidecars import PluginRecord

    lib = tmp_path / "libqkrope_plugin.so"
    lib.write_bytes(b"v1")
    record = PluginRecord(str(lib), sha256_file(lib))
    assert resolve_plugin_library(None, record, check_hash="warn") == lib
    other = tmp_path / "other.so"
    other.write_bytes(b"v2")
    with pytest.warns(RuntimeWarning, match="differs from the one the engine was built with"):
        assert resolve_plugin_library(other, record, check_hash="warn") == other
    with pytest.raises(FileNotFoundError, match="qkrope build-plugin"):
        resolve_plugin_library(tmp_path / "missing.so", record, check_hash="warn")


# --------------------------------------------------------------------------------------------
# The node contract and unreadable files, before ONNX Runtime sees the model (issue 10, 3 and 6)
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
        rn.load(bad)
    assert node in str(info.value)


@pytest.mark.parametrize("case", list(BROKEN_FILES))
def test_load_refuses_unreadable_onnx_files_clearly(exported, tmp_path, monkeypatch, case):
    from qkrope.errors import QkropeError

    bad = write_broken_copy(exported[0], tmp_path / "broken.onnx", case)
    _no_session(monkeypatch)
    with pytest.raises(QkropeError, match=r"not a readable ONNX model.*qkrope export"):
        rn.load(bad)


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
        r = rn.load(path)
        r.run_qwen(*inputs()[:2], img_shapes=IMG_SHAPES)


def test_messages_say_the_right_fix(runner):
    """2-D activations are a rank error (not a cache overflow), batch 0 on an ONNX model is not
    an engine-profile problem, float64 is cast to the model's dtype, sparse tensors are made
    dense."""
    hs, ehs, caches = inputs()
    with pytest.raises(rn.RunnerInputError, match="3-D") as info:
        runner(hs[0], ehs, caches)
    assert "rows" not in str(info.value) and "overflow" not in str(info.value)
    with pytest.raises(rn.RunnerInputError, match="3-D"):
        rn.check_inputs(runner.io, {runner.io.roles["hidden_states"]: hs[0]},
                        device=torch.device("cpu"))
    with pytest.raises(rn.RunnerInputError, match=r"batch.* 0.*at least 1") as info:
        runner(hs[:0], ehs[:0], caches)
    assert "qkrope build" not in str(info.value) and "engine" not in str(info.value)
    with pytest.raises(rn.RunnerInputError, match=r"cast .*model's dtype float32.*"
                                                  r"\.to\(torch\.float32\)") as info:
        runner(hs.double(), ehs.double(), caches)
    assert "export the model in float64" not in str(info.value)
    for args in ((hs.to_sparse(), ehs, caches), (hs, ehs, caches,
                                                 torch.ones(2, S_TXT, dtype=torch.bool).to_sparse())):
        with pytest.raises(rn.RunnerInputError, match=r"sparse.*\.to_dense\(\)") as info:
            runner(*args)
        assert ".contiguous()" not in str(info.value)


def test_engine_profile_range_still_says_rebuild():
    """The 'rebuild with qkrope build' advice stays where it is right: a TensorRT profile."""
    spec = rn.spec_from_shape("x", "float32", ["batch", 4], bounds=([1, 4], [2, 4]))
    io = rn.ModelIO([spec], [], 16, {}, profile_bounds=True)
    with pytest.raises(rn.RunnerInputError, match="qkrope build"):
        rn.check_inputs(io, {"x": torch.zeros(3, 4)}, device=torch.device("cpu"))
    with pytest.raises(rn.RunnerInputError, match="at least 1"):
        rn.check_inputs(io, {"x": torch.zeros(0, 4)}, device=torch.device("cpu"))


@pytest.mark.parametrize("content", ["onnx", "empty"])
def test_load_of_an_engine_that_is_not_one_is_refused_before_tensorrt(exported, tmp_path,
                                                                      monkeypatch, content):
    monkeypatch.setitem(sys.modules, "tensorrt", None)
    fake = tmp_path / "m.engine"
    fake.write_bytes(Path(exported[0]).read_bytes() if content == "onnx" else b"")
    with pytest.raises(rn.RunnerError, match="not a TensorRT engine"):
        rn.load(fake)


# --------------------------------------------------------------------------------------------
# Several optimisation profiles: the runner's choice; CUDA graph bookkeeping (fake engine and a
# stand-in for the CUDA calls; the real capture is in test_trt_runner_cuda_graph_on_gpu)
# --------------------------------------------------------------------------------------------

def _profile(batch, img, txt):
    """{input: (min, opt, max)} of a profile up to (batch, img, txt); batch = (lo, hi)."""
    b0, b1 = batch
    return {"hidden_states": ((b0, 1, C), (b1, img, C), (b1, img, C)),
            "encoder_hidden_states": ((b0, 1, C), (b1, txt, C), (b1, txt, C)),
            "encoder_hidden_states_mask": ((b0, 1), (b1, txt), (b1, txt)),
            "img_cos_sin_cache": ((1, HEAD_DIM), (img, HEAD_DIM), (img, HEAD_DIM)),
            "txt_cos_sin_cache": ((1, HEAD_DIM), (txt, HEAD_DIM), (txt, HEAD_DIM))}


def _multi_engine(profiles):
    io = [(n, t, s, None, ft.TensorIOMode.INPUT) for n, t, s in (
        ("hidden_states", "FLOAT", [-1, -1, C]), ("encoder_hidden_states", "FLOAT", [-1, -1, C]),
        ("encoder_hidden_states_mask", "BOOL", [-1, -1]),
        ("img_cos_sin_cache", "FLOAT", [-1, HEAD_DIM]),
        ("txt_cos_sin_cache", "FLOAT", [-1, HEAD_DIM]))]
    io += [("img_out", "FLOAT", [-1, -1, C], None, ft.TensorIOMode.OUTPUT),
           ("txt_out", "FLOAT", [-1, -1, C], None, ft.TensorIOMode.OUTPUT)]
    return ft.ICudaEngine(io, profiles=profiles, output_like={
        "img_out": "hidden_states", "txt_out": "encoder_hidden_states"})


def _engine_sidecar(labels=()):
    from qkrope.sidecars import EngineInfo, EngineTensor

    axes = {"hidden_states": ["batch", "img_tokens", None],
            "encoder_hidden_states": ["batch", "txt_tokens", None],
            "encoder_hidden_states_mask": ["batch", "txt_tokens"],
            "img_cos_sin_cache": ["img_cache_rows", None],
            "txt_cos_sin_cache": ["txt_cache_rows", None]}
    return EngineInfo(
        tensorrt_version="10.14", onnx="/m.onnx",
        inputs=[EngineTensor(n, "float32", [-1] * len(a), a) for n, a in axes.items()],
        outputs=[], profiles=[], plugin=None, plugin_layers=2, version_compatible=False,
        strongly_typed=True, config={"head_dim": HEAD_DIM, "axes_dims_rope": [2, 6, 8]},
        profile_labels=list(labels))


class FakeCuda:
    """Stands in for rn.TorchCuda: streams are plain objects, graphs record what they
    captured and count replays."""

    class Graph:
        def __init__(self):
            self.captured, self.replays = [], 0

    def __init__(self):
        self.graphs, self.capturing = [], None

    def new_stream(self, device):
        return types.SimpleNamespace(cuda_stream=1000 + len(self.graphs))

    def current_stream(self, device):
        return types.SimpleNamespace(cuda_stream=0)

    def handle(self, stream):
        return stream.cuda_stream

    def wait(self, a, b):
        pass

    def record(self, t, s):
        pass

    def stream_scope(self, s):
        import contextlib
        return contextlib.nullcontext()

    def new_graph(self):
        g = FakeCuda.Graph()
        self.graphs.append(g)
        return g

    def capture(self, graph, stream):
        import contextlib

        @contextlib.contextmanager
        def cm():
            self.capturing = graph
            yield
            self.capturing = None
        return cm()

    def replay(self, graph, stream):
        graph.replays += 1


import types  # noqa: E402


def _fake_trt_runner(profiles, labels=(), cuda_graph=False):
    trt, _ = ft.make_fake_trt()
    engine = _multi_engine(profiles)
    r = rn.TensorRTRunner.__new__(rn.TensorRTRunner)
    cuda = FakeCuda()
    r._setup(engine, trt, _engine_sidecar(labels), device=torch.device("cpu"), cuda=cuda,
             cuda_graph=cuda_graph)
    r._check_device = lambda device: None
    return r, engine, cuda


def _qwen_inputs(batch, grid, s_txt):
    return inputs(batch=batch, s_img=grid * grid, s_txt=s_txt, img_shapes=[(1, grid, grid)])


def test_trt_runner_picks_the_first_profile_holding_the_shapes():
    presets = [_profile((1, 2), 16, 8), _profile((1, 2), 64, 8), _profile((1, 2), 256, 8)]
    r, engine, _ = _fake_trt_runner(presets, labels=["64x64", "128x128", "256x256"])
    assert r.io.input("hidden_states").dims == ((1, 2), (1, 256), (C, C))  # the union
    assert r.select_profile({"hidden_states": (2, 16, C)}) == 0
    for grid, want in ((4, 0), (8, 1), (6, 1), (16, 2), (4, 0)):
        r(*_qwen_inputs(2, grid, 5))
        assert engine.calls[-1][0] == "execute_async_v3" and engine.calls[-1][1] == want
    # one context per profile used on this thread, each bound to its profile on the stream
    assert [c.profile for c in engine.contexts] == [0, 1, 2]
    assert [c[1] for c in engine.calls if c[0] == "set_optimization_profile_async"] == [0, 1, 2]
    # a second thread gets its own contexts
    t = threading.Thread(target=lambda: r(*_qwen_inputs(1, 4, 3)))
    t.start()
    t.join()
    assert len(engine.contexts) == 4 and engine.contexts[-1].profile == 0
    # beyond every profile: refused before anything runs (the union's bounds)
    n = len(engine.calls)
    with pytest.raises(rn.RunnerInputError, match="outside the range"):
        r(*_qwen_inputs(2, 18, 5))
    assert len(engine.calls) == n


def test_trt_runner_refuses_shapes_no_profile_holds_naming_them():
    # profile 0: batch 1, up to 256 image tokens; profile 1: batch 2, up to 16
    r, engine, _ = _fake_trt_runner([_profile((1, 1), 256, 8), _profile((2, 2), 16, 8)],
                                    labels=["single", "cfg"])
    r(*_qwen_inputs(1, 16, 5))
    r(*_qwen_inputs(2, 4, 5))
    assert [c[1] for c in engine.calls if c[0] == "execute_async_v3"] == [0, 1]
    with pytest.raises(rn.RunnerInputError, match=r"no optimisation profile.*hidden_states 2x64x"
                       r".*\n  profile 0 \(single\): hidden_states 1x1x\d+..1x256x\d+.*\n  "
                       r"profile 1 \(cfg\)"):
        r(*_qwen_inputs(2, 8, 5))


def test_trt_runner_cuda_graph_captures_once_per_shapes_then_replays():
    r, engine, cuda = _fake_trt_runner([_profile((1, 2), 16, 8), _profile((1, 2), 64, 8)],
                                       cuda_graph=True)
    hs, ehs, caches = _qwen_inputs(2, 4, 5)
    out1 = r(hs, ehs, caches)
    assert len(cuda.graphs) == 1
    execs = [c for c in engine.calls if c[0] == "execute_async_v3"]
    assert len(execs) == 2  # one eager run, then the captured one
    ctx = engine.contexts[0]
    static = ctx.addresses["hidden_states"]
    assert static != hs.data_ptr()  # bound to the graph's static input buffer
    hs2, ehs2, caches2 = _qwen_inputs(2, 4, 5)
    out2 = r(hs2 + 1, ehs2, caches2)
    assert len(cuda.graphs) == 1 and cuda.graphs[0].replays == 1
    assert len([c for c in engine.calls if c[0] == "execute_async_v3"]) == 2  # replay only
    assert out2[0].data_ptr() == out1[0].data_ptr()  # the graph's static outputs
    # the static input holds the new call's values
    graph, static_in, _outs = next(iter(r._local.graphs.values()))
    assert torch.equal(static_in["hidden_states"], hs2 + 1)
    # other shapes (another profile): a second capture; then a replay of the first again
    r(*_qwen_inputs(2, 8, 5))
    assert len(cuda.graphs) == 2 and engine.contexts[-1].profile == 1
    r(*_qwen_inputs(2, 4, 5))
    assert cuda.graphs[0].replays == 2 and cuda.graphs[1].replays == 0


def test_trt_runner_without_cuda_graph_captures_nothing():
    r, engine, cuda = _fake_trt_runner([_profile((1, 2), 16, 8)])
    r(*_qwen_inputs(2, 4, 5))
    r(*_qwen_inputs(2, 4, 5))
    assert cuda.graphs == [] and len(engine.contexts) == 1
    assert not any(c[0] == "set_optimization_profile_async" for c in engine.calls)


def test_trt_runner_cuda_graph_on_gpu(tmp_path):
    """The real capture: needs an engine built here (QKROPE_TEST_ENGINE) on a CUDA GPU."""
    import os

    trt = pytest.importorskip("tensorrt", reason="requires TensorRT and CUDA")
    if not torch.cuda.is_available() or not os.environ.get("QKROPE_TEST_ENGINE"):
        pytest.skip("requires TensorRT and CUDA (and QKROPE_TEST_ENGINE=an attention-block "
                    "engine built by `qkrope build`)")
    del trt
    eager = rn.load(os.environ["QKROPE_TEST_ENGINE"], copy_outputs=True)
    graphed = rn.load(os.environ["QKROPE_TEST_ENGINE"], copy_outputs=True, cuda_graph=True)
    spec = eager.io.input(eager.io.roles["hidden_states"])
    width = spec.dims[2][0]
    for seed in (0, 1, 2):
        g = torch.Generator().manual_seed(seed)
        dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16}.get(spec.dtype,
                                                                           torch.float32)
        hs = torch.randn(1, 16, width, generator=g).to("cuda", dtype)
        ehs = torch.randn(1, 5, width, generator=g).to("cuda", dtype)
        a = eager.run_qwen(hs, ehs, img_shapes=[(1, 4, 4)])
        b = graphed.run_qwen(hs, ehs, img_shapes=[(1, 4, 4)])
        torch.cuda.synchronize()
        for x, y in zip(a, b):
            torch.testing.assert_close(x, y)


def test_trt_runner_refuses_a_sidecar_config_the_engine_was_not_built_from():
    """A permuted axes_dims_rope in the engine sidecar (engine_sha256 still valid) would build
    other RoPE caches: the engine's name records its build's config tag, which disagrees."""
    from qkrope.sidecars import EngineInfoError, config_tag

    trt, _ = ft.make_fake_trt()
    side = _engine_sidecar()
    engine = _multi_engine([_profile((1, 2), 16, 8)])
    engine.name = config_tag(side.config)
    r = rn.TensorRTRunner.__new__(rn.TensorRTRunner)
    r._setup(engine, trt, side, device=torch.device("cpu"), cuda=FakeCuda())  # agrees
    side.config.axes_dims_rope = side.config.axes_dims_rope[::-1]
    r = rn.TensorRTRunner.__new__(rn.TensorRTRunner)
    with pytest.raises(EngineInfoError, match="describes another config than the one"):
        r._setup(engine, trt, side, device=torch.device("cpu"), cuda=FakeCuda())
def test_trt_runner_keeps_the_cuda_graphs_of_the_last_shapes_only():
    """Ever new shapes with cuda_graph=True: the graphs (and their static buffers) a thread
    keeps stay bounded; a shape that comes back after being dropped is captured again."""
    r, engine, cuda = _fake_trt_runner([_profile((1, 2), 64, 8)], cuda_graph=True)
    grids = [2, 3, 4, 5, 6, 7]  # six sets of shapes
    for grid in grids:
        r(*_qwen_inputs(2, grid, 5))
    assert len(cuda.graphs) == len(grids)
    assert len(r._local.graphs) == rn.GRAPHS_PER_THREAD
    r(*_qwen_inputs(2, grids[-1], 5))  # kept: replayed
    assert len(cuda.graphs) == len(grids) and cuda.graphs[-1].replays == 1
    r(*_qwen_inputs(2, grids[0], 5))  # dropped: captured again
    assert len(cuda.graphs) == len(grids) + 1
    assert len(r._local.graphs) == rn.GRAPHS_PER_THREAD
