"""TensorRT engine build and the TensorRT runner, on a GPU with TensorRT (skipped elsewhere).

Run where TensorRT 10.7+ and CUDA exist, after `qkrope build-plugin`:

    python -m pytest -q tests/test_tensorrt_gpu.py

Covers: the engine really uses the QKNormRoPE plugin (one plugin layer per node), the sidecar,
the TensorRT runner against ONNX Runtime (fp32) and the eager module (bf16), dynamic shapes inside
the profile, checks before execution, per-thread contexts, a version-compatible build, the CLI
with a timing cache, a refit round trip by parameter name, and the opset-23 Attention form.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import threading
from pathlib import Path

import pytest
import torch

from qkrope.sidecars import ModelInfo

pytestmark = [
    pytest.mark.tensorrt,
    pytest.mark.skipif(importlib.util.find_spec("tensorrt") is None or not torch.cuda.is_available(),
                       reason="requires TensorRT and CUDA"),
]

HEADS, HEAD_DIM = 2, 64
C = HEADS * HEAD_DIM
IMG_SHAPES = [(1, 4, 4)]
S_TXT = 6


def _plugin(kind="plugin") -> str:
    from qkrope.runtime.plugin_build import PluginNotBuiltError, find_plugin_library

    try:
        return str(find_plugin_library(kind))
    except PluginNotBuiltError as exc:
        pytest.skip(f"plugin library not built: {exc}")


def _export(path: Path, dtype: str):
    from qkrope.export.onnx_export import build_attention, export_attention

    export_attention(path, heads=HEADS, head_dim=HEAD_DIM, img_shapes=IMG_SHAPES, txt_len=S_TXT,
                     batch=2, dtype=dtype)
    return build_attention(ModelInfo.load(path))


def _build(onnx_path: Path, engine_path: Path, **kw):
    from qkrope.runtime.engine import BuildOptions, build_engine

    opts = BuildOptions(plugin=kw.pop("plugin", None) or _plugin(), max_img_tokens=64,
                        max_txt_tokens=16, max_batch=2, progress=False, **kw)
    return build_engine(onnx_path, engine_path, opts)


@pytest.fixture(scope="module")
def fp32(tmp_path_factory):
    d = tmp_path_factory.mktemp("trt32")
    module = _export(d / "attn.onnx", "fp32")
    side = _build(d / "attn.onnx", d / "attn.engine")
    return d, module, side


def _inputs(device, dtype=torch.float32, batch=2, img_shapes=IMG_SHAPES, s_txt=S_TXT, seed=0,
            axes_dim=None):
    from qkrope.runtime import build_qwen_rope_caches

    g = torch.Generator().manual_seed(seed)
    s_img = sum(f * h * w for f, h, w in img_shapes)
    hs = torch.randn(batch, s_img, C, generator=g).to(device, dtype)
    ehs = torch.randn(batch, s_txt, C, generator=g).to(device, dtype)
    from qkrope.export.onnx_export import default_axes_dims

    caches = build_qwen_rope_caches(img_shapes, s_txt, axes_dim=axes_dim or
                                    default_axes_dims(HEAD_DIM), device=device)
    return hs, ehs, (caches.img, caches.txt)


def test_engine_uses_plugin_and_writes_sidecar(fp32):
    d, _, side = fp32
    assert (d / "attn.engine").stat().st_size > 0
    on_disk = json.loads((d / "attn.engine.json").read_text())
    assert on_disk["plugin_layers"] == 2 == side.plugin_layers
    assert on_disk["gpu"]["compute_capability"]
    assert on_disk["profiles"][0]["hidden_states"]["max"] == [2, 64, C]
    assert on_disk["plugin"]["sha256"]


@pytest.mark.parametrize("batch,img_shapes,s_txt", [(2, IMG_SHAPES, S_TXT), (1, [(1, 2, 3)], 3),
                                                   (2, [(1, 8, 8)], 16)])
def test_trt_runner_matches_onnxruntime(fp32, batch, img_shapes, s_txt):
    from qkrope.runtime import load

    d, _, _ = fp32
    trt_runner = load(d / "attn.engine", copy_outputs=True)
    ort_runner = load(d / "attn.onnx", providers=["CPUExecutionProvider"])
    hs, ehs, caches = _inputs("cuda", batch=batch, img_shapes=img_shapes, s_txt=s_txt)
    mask = torch.ones(batch, s_txt, dtype=torch.bool, device="cuda")
    mask[0, -1] = False
    got = trt_runner(hs, ehs, caches, mask)
    want = ort_runner(hs.cpu(), ehs.cpu(), tuple(c.cpu() for c in caches), mask.cpu())
    for g, w in zip(got, want):
        assert g.is_cuda
        torch.testing.assert_close(g.cpu(), w, atol=2e-4, rtol=1e-3)


def test_trt_runner_checks_before_execution_and_reuses_outputs(fp32):
    from qkrope.runtime import RopeCacheError, RunnerInputError, load

    d, _, _ = fp32
    r = load(d / "attn.engine")
    hs, ehs, caches = _inputs("cuda")
    a, _ = r(hs, ehs, caches)
    b, _ = r(hs, ehs, caches)
    assert a.data_ptr() == b.data_ptr()
    with pytest.raises(RopeCacheError, match="is on cpu"):
        r(hs, ehs, tuple(c.cpu() for c in caches))
    with pytest.raises(RunnerInputError, match="outside the range"):
        r(*_inputs("cuda", s_txt=17))
    with pytest.raises(RunnerInputError, match="TensorRT engine runs on"):
        r(hs.cpu(), ehs.cpu(), tuple(c.cpu() for c in caches))


def test_trt_runner_threads(fp32):
    from qkrope.runtime import load

    d, module, _ = fp32
    r = load(d / "attn.engine")
    module = module.cuda()
    errors, done = [], []

    def work(seed):
        try:
            hs, ehs, caches = _inputs("cuda", seed=seed)
            for _ in range(5):
                img, txt = r(hs, ehs, caches)
            torch.cuda.current_stream().synchronize()
            with torch.no_grad():
                ref_img, _ = module(hs, ehs, caches)
            torch.testing.assert_close(img, ref_img, atol=2e-4, rtol=1e-3)
            done.append(seed)
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert sorted(done) == [0, 1, 2]


def test_bf16_engine_vs_eager(tmp_path):
    from qkrope.runtime import load

    module = _export(tmp_path / "bf16.onnx", "bf16").cuda()
    _build(tmp_path / "bf16.onnx", tmp_path / "bf16.engine")
    r = load(tmp_path / "bf16.engine")
    hs, ehs, caches = _inputs("cuda", torch.bfloat16)
    img, txt = r(hs, ehs, caches)
    with torch.no_grad():
        ref_img, ref_txt = module(hs, ehs, caches)
    assert img.dtype == torch.bfloat16
    # one bf16 rounding step apart at most (sglang's fused-kernel tolerance)
    torch.testing.assert_close(img, ref_img, atol=8e-2, rtol=1e-2)
    torch.testing.assert_close(txt, ref_txt, atol=8e-2, rtol=1e-2)


_VC_SCRIPT = r"""
import sys, torch
from qkrope import cli
from qkrope.runtime import load, build_qwen_rope_caches
onnx_path, engine_path, lib, C, axes = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), eval(sys.argv[5])
rc = cli.main(["build", onnx_path, "-o", engine_path, "--plugin", lib, "--version-compatible",
               "--max-img-tokens", "64", "--max-txt-tokens", "16", "--no-progress"])
assert rc == 0, rc
r = load(engine_path, copy_outputs=True)
o = load(onnx_path, providers=["CPUExecutionProvider"])
g = torch.Generator().manual_seed(0)
hs, ehs = torch.randn(2, 16, C, generator=g), torch.randn(2, 6, C, generator=g)
c = build_qwen_rope_caches([(1, 4, 4)], 6, axes_dim=axes)
got = r(hs.cuda(), ehs.cuda(), (c.img.cuda(), c.txt.cuda()))
want = o(hs, ehs, (c.img, c.txt))
for a, b in zip(got, want):
    torch.testing.assert_close(a.cpu(), b, atol=2e-4, rtol=1e-3)
print("VC OK")
"""


def test_version_compatible_engine(fp32, tmp_path):
    # A fresh process: the self-registering library loaded by the other tests would clash with
    # the VC library's creators in this process's plugin registry.
    import subprocess
    import sys

    from qkrope.export.onnx_export import default_axes_dims

    d, _, _ = fp32
    proc = subprocess.run(
        [sys.executable, "-c", _VC_SCRIPT, str(d / "attn.onnx"), str(tmp_path / "vc.engine"),
         _plugin("vc"), str(C), repr(tuple(default_axes_dims(HEAD_DIM)))],
        capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "VC OK" in proc.stdout, proc.stdout + proc.stderr
    side = json.loads((tmp_path / "vc.engine.json").read_text())
    assert side["version_compatible"] and side["plugin"]["serialized_in_engine"]


def test_cli_build_with_timing_cache(fp32, tmp_path):
    from qkrope import cli

    d, _, _ = fp32
    out, cache = tmp_path / "cli.engine", tmp_path / "timing.cache"
    rc = cli.main(["build", str(d / "attn.onnx"), "-o", str(out), "--plugin", _plugin(),
                   "--max-img-tokens", "64", "--max-txt-tokens", "16", "--timing-cache",
                   str(cache), "--builder-optimization-level", "2", "--no-progress"])
    assert rc == 0
    assert out.stat().st_size > 0 and cache.stat().st_size > 0
    assert json.loads(Path(str(out) + ".json").read_text())["builder_optimization_level"] == 2


def test_refit_round_trip(tmp_path):
    """build --refit marks exactly the exported parameters refittable; qkrope refit with another
    seed's weights (by diffusers name) makes the engine compute that model."""
    import tensorrt as trt
    from safetensors.torch import save_file

    from qkrope import cli, runtime
    from qkrope.export.onnx_export import build_attention

    module_a = _export(tmp_path / "a.onnx", "fp32")
    side = _build(tmp_path / "a.onnx", tmp_path / "a.engine", refit=True)
    assert side.refittable and side.refit_mode == "individual"  # no fallback to REFIT
    params = side.config.parameters
    engine = trt.Runtime(trt.Logger(trt.Logger.WARNING)).deserialize_cuda_engine(
        (tmp_path / "a.engine").read_bytes())
    names = set(trt.Refitter(engine, trt.Logger(trt.Logger.WARNING)).get_all_weights())
    assert set(params) <= names  # every parameter refittable
    del engine
    model_a = ModelInfo.load(tmp_path / "a.onnx")
    module_b = build_attention(dataclasses.replace(
        model_a, config=dataclasses.replace(model_a.config, seed=1)))
    save_file({k: v.contiguous() for k, v in module_b.state_dict().items()},
              str(tmp_path / "b.safetensors"))
    assert cli.main(["refit", str(tmp_path / "a.engine"), "--state-dict",
                     str(tmp_path / "b.safetensors"), "-o", str(tmp_path / "b.engine")]) == 0
    hs, ehs, caches = _inputs("cuda")
    mask = torch.ones(hs.shape[0], S_TXT, dtype=torch.bool, device="cuda")
    mask[0, -1] = False
    outs = {}
    for path, module in ((tmp_path / "a.engine", module_a), (tmp_path / "b.engine", module_b)):
        got = runtime.load(path, copy_outputs=True)(hs, ehs, caches, mask)
        with torch.no_grad():
            ref = module.cuda()(hs, ehs, caches, mask)
        for g, r in zip(got, ref):  # the tolerance of test_trt_runner_matches_onnxruntime
            torch.testing.assert_close(g, r, atol=2e-4, rtol=1e-3)
        outs[path.stem] = got[0]
    assert not torch.allclose(outs["a"], outs["b"])  # the refit changed what it computes


def test_onnx23_attention_engine(tmp_path):
    """--attention onnx23 parses (TensorRT 10.14+ has the Attention operator) and matches ORT."""
    import tensorrt as trt

    from qkrope import runtime
    from qkrope.export.onnx_export import export_attention

    if tuple(int(x) for x in trt.__version__.split(".")[:2]) < (10, 14):
        pytest.skip(f"requires TensorRT 10.14+ (the ONNX Attention operator); found "
                    f"{trt.__version__}")
    export_attention(tmp_path / "a23.onnx", heads=HEADS, head_dim=HEAD_DIM, img_shapes=IMG_SHAPES,
                     txt_len=S_TXT, batch=2, attention="onnx23")
    _build(tmp_path / "a23.onnx", tmp_path / "a23.engine")
    hs, ehs, caches = _inputs("cuda")
    mask = torch.ones(hs.shape[0], S_TXT, dtype=torch.bool, device="cuda")
    mask[0, -1] = False
    got = runtime.load(tmp_path / "a23.engine", copy_outputs=True)(hs, ehs, caches, mask)
    ort_runner = runtime.load(tmp_path / "a23.onnx", providers=["CPUExecutionProvider"])
    ref = ort_runner(hs.cpu(), ehs.cpu(), tuple(c.cpu() for c in caches), mask.cpu())
    for g, r in zip(got, ref):  # the tolerance of test_trt_runner_matches_onnxruntime
        torch.testing.assert_close(g.cpu(), r, atol=2e-4, rtol=1e-3)
