"""``qkrope bench``: the command (the CPU path end to end, tiny sizes, a few seconds; its
one-line errors) and the package face that keeps the names of every part."""

from __future__ import annotations

import importlib
import json

import pytest
import torch

from qkrope.cli import main as cli_main
from qkrope.apps import bench
from qkrope.runtime.caches import default_axes_dims

try:
    import qkrope.export.onnx_export  # noqa: F401
    HAVE_EXPORTER = True
except ImportError:
    HAVE_EXPORTER = False

#: the modules of qkrope.apps.bench
PARTS = ("backends", "config", "inspector", "orchestrate", "ort_profile", "plot", "rows")
#: private names the bench module had before its parts had modules
OLD_PRIVATE_NAMES = ("_bench_kernel", "_build_engines", "_engine_backend", "_export_onnx",
                     "_have_tensorrt", "_inspect_engine", "_make_block", "_make_feeds",
                     "_make_inputs", "_ort_session", "_torch_backends", "_measure", "_skip_all",
                     "_row", "_run_bench", "_bench_in", "_export_forms")


def _parts():
    return [importlib.import_module(f"qkrope.apps.bench.{p}") for p in PARTS]


def test_the_package_face_keeps_every_parts_names():
    """``qkrope.apps.bench`` offers every public name that its parts define, and the private
    ones it had before the split, as the very objects of the part."""
    import ast
    import inspect

    for mod in _parts():
        tree = ast.parse(inspect.getsource(mod))
        names = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
        names += [t.id for n in tree.body if isinstance(n, (ast.Assign, ast.AnnAssign))
                  for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
                  if isinstance(t, ast.Name)]
        for name in names:
            if not name.startswith("_") or name in OLD_PRIVATE_NAMES:
                assert getattr(bench, name, None) is getattr(mod, name), f"{mod.__name__}.{name}"
    assert all(hasattr(bench, name) for name in OLD_PRIVATE_NAMES)


def test_the_rope_split_is_the_caches_modules():
    # the RoPE split is the caches module's (the exporter uses the same): no private copy
    assert not hasattr(bench, "qwen_axes_dim")
    assert bench.default_axes_dims is default_axes_dims


def test_no_private_dtype_tables_or_global_seed():
    import inspect

    for mod in (bench, *_parts()):
        src = inspect.getsource(mod)
        assert "torch.manual_seed" not in src, mod.__name__
        for name in ("_DTYPES", "_SHORT_DTYPE", "_torch_dtype", "_ort_feeds"):
            assert not hasattr(mod, name), (mod.__name__, name)
    assert set(bench.DTYPE_CHOICES) == {"fp32", "fp16", "bf16"}  # export's spellings


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU path")
def test_cpu_bench_writes_table_and_png(tmp_path, capsys):
    out = tmp_path / "bench"
    threads_before = torch.get_num_threads()
    rc = cli_main(["bench", "--sizes", "64,128", "--batches", "1", "--heads", "2",
                   "--head-dim", "32", "--text-len", "8", "--iters", "3", "--warmup", "1",
                   "--out", str(out)])
    assert rc == 0
    assert torch.get_num_threads() == threads_before and torch.is_grad_enabled()  # restored
    stdout = capsys.readouterr().out
    png = (out / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 1000
    md = (out / "bench.md").read_text()
    rows = json.loads((out / "bench.json").read_text())
    by = {(r["backend"], r["size"]): r for r in rows if r["attention"] != "onnx23"}

    # measured: torch eager (and ONNX Runtime when the exporter is present), with the machine
    for size, tokens in ((64, 16), (128, 64)):
        r = by[("torch-eager", size)]
        assert r["status"] == "ok" and r["median_ms"] > 0 and r["img_tokens"] == tokens
        assert r["machine"]["torch"] == torch.__version__ and r["machine"]["cpu"]
        assert "onnxruntime" in r["machine"] and "tensorrt" in r["machine"]
        assert f"| torch-eager | sdpa | 1 | {size} | {tokens} | 8 | 1 | float32 |" in md
        ort = by[("onnxruntime-cpu", size)]
        if not HAVE_EXPORTER:  # the exporter is another module of this project
            assert ort["status"] == "skipped" and "ONNX export failed" in ort["reason"]
            continue
        assert ort["status"] == "ok" and ort["median_ms"] > 0, ort
        assert ort["machine"]["onnxruntime"] not in ("", "not installed")
        assert f"| onnxruntime-cpu | primitive | 1 | {size} | {tokens} | 8 | 1 | float32 |" in md
        assert ort["threads"] == 1 and ort["ort_vs_eager"] == pytest.approx(
            ort["median_ms"] / r["median_ms"])
        assert ort["profile"]["top_ops"] and ort["profile"]["total_us"] > 0
    # one CPU thread by default (no --threads), said above the table and in every row
    assert {r["machine"]["cpu_threads"] for r in rows if r["status"] == "ok"} == {"1"}
    assert {r["threads"] for r in rows if r["status"] == "ok"} == {1}
    for text in (md, stdout):
        assert "CPU threads (torch, ONNX Runtime): 1; backends measured interleaved" in text
    # GPU rows: skipped, with the reason, in the file and on stdout
    for backend in ("trt-plugin", "trt-function-body", "torch-compile", "kernel"):
        for size in (64, 128):
            r = by[(backend, size)]
            assert r["status"] == "skipped" and "requires CUDA" in r["reason"], r
    assert "requires TensorRT" in by[("trt-plugin", 64)]["reason"]
    for text in (md, stdout):
        assert "- trt-plugin: skipped, requires CUDA" in text
        assert "- kernel: skipped, requires CUDA" in text
        assert "- torch-compile: skipped, requires CUDA" in text
    assert not [p for p in out.iterdir() if p.name.startswith("qkrope-bench-")]  # temp removed


def test_bad_arguments_are_one_line_errors(capsys):
    assert cli_main(["bench", "--sizes", "500", "--device", "cpu"]) == 2
    assert "multiple of 16" in capsys.readouterr().err


def test_cuda_device_without_gpu_is_one_line(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli_main(["bench", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA GPU" in err and err.count("\n") == 1
