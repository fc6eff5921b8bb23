"""``qkrope bench``: pure helpers and the CPU path (tiny sizes, a few seconds)."""

from __future__ import annotations

import json

import pytest
import torch

from qkrope.cli import main as cli_main
from qkrope.apps import bench, measure
from qkrope.runtime.caches import default_axes_dims

try:
    import qkrope.export.onnx_export  # noqa: F401
    HAVE_EXPORTER = True
except ImportError:
    HAVE_EXPORTER = False


def test_bytes_moved_matches_the_design_figure():
    # 1024x1024 image (4096 tokens) + 512 text tokens, 24 heads x 128, bf16, fp32 cache.
    assert measure.image_tokens(1024) == 4096 and measure.image_tokens(512) == 1024
    n = measure.qknorm_rope_bytes(4096, 512, 24, 128, act_bytes=2)
    # q, k read + q_out, k_out written: 4 x 4608 x 24 x 128 x 2 B = 113,246,208
    # cache rows: 4608 x 128 x 4 B = 2,359,296; weights: 4 x 128 x 2 B = 1,024
    assert n == 113_246_208 + 2_359_296 + 1_024 == 115_606_528
    assert round(n / 1e6, 1) == 115.6                       # DESIGN.md: "about 115.6 MB"
    assert round(n / 4.8e12 * 1e6, 1) == 24.1               # "24.1 us at 4.8 TB/s"
    # batch doubles the activations, not the cache rows or weights
    assert measure.qknorm_rope_bytes(4096, 512, 24, 128, batch=2) == 2 * 113_246_208 + 2_360_320
    # partial rotary reads fewer cache columns
    assert measure.qknorm_rope_bytes(1, 0, 1, 128, rotary_dim=64, act_bytes=4) == \
        4 * 128 * 4 + 2 * 128 * 4 + 64 * 4 + 2 * 128 * 4


def test_summarize():
    st = measure.summarize([5.0, 1.0, 3.0, 2.0, 4.0])
    assert st["median_ms"] == 3.0 and st["min_ms"] == 1.0 and st["mean_ms"] == 3.0
    assert st["p10_ms"] == pytest.approx(1.4) and st["p90_ms"] == pytest.approx(4.6)
    assert st["n"] == 5
    assert measure.summarize([2.0])["stdev_ms"] == 0.0
    assert measure.summarize([1.0, 2.0])["median_ms"] == 1.5
    with pytest.raises(ValueError):
        measure.summarize([])


def test_peak_table_and_parsing():
    assert measure.peak_gbps("NVIDIA H200") == 4800.0
    assert measure.peak_gbps("NVIDIA H100 PCIe") == 2000.0
    assert measure.peak_gbps("NVIDIA H100 80GB HBM3") == 3350.0
    assert measure.peak_gbps("NVIDIA GH200 480GB") == 4000.0
    assert measure.peak_gbps("Some Future GPU") is None
    assert measure.peak_gbps("NVIDIA H200", override=1234) == 1234.0
    assert bench.parse_int_list("512, 1024") == [512, 1024]
    with pytest.raises(ValueError):
        bench.parse_int_list("512,x")
    with pytest.raises(ValueError):
        measure.image_tokens(500)
    # the RoPE split is the caches module's (the exporter uses the same): no private copy
    assert not hasattr(bench, "qwen_axes_dim")
    assert bench.default_axes_dims is default_axes_dims


def test_no_private_dtype_tables_or_global_seed():
    import inspect

    src = inspect.getsource(bench)
    assert "torch.manual_seed" not in src
    for name in ("_DTYPES", "_SHORT_DTYPE", "_torch_dtype", "_ort_feeds"):
        assert not hasattr(bench, name), name
    assert set(bench.DTYPE_CHOICES) == {"fp32", "fp16", "bf16", "float32", "float16", "bfloat16"}


def test_cpu_threads_default_to_one_on_the_cpu():
    cfg = bench.Config(sizes=[64], batches=[1], dtype="float32", heads=2, head_dim=32,
                       text_len=8, iters=1, warmup=0, device="cpu")
    assert bench.cpu_threads(cfg) == 1 == bench.DEFAULT_CPU_THREADS
    cfg.threads = 3
    assert bench.cpu_threads(cfg) == 3
    cfg.threads, cfg.device = None, "cuda"
    assert bench.cpu_threads(cfg) is None


def test_time_interleaved_rotates_backends_and_isolates_failures():
    calls = []

    def boom():
        calls.append("c")
        if len([c for c in calls if c == "c"]) > 2:
            raise RuntimeError("third call")

    res = measure.time_interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b"),
                                  "c": boom}, iters=4, warmup=1)
    assert calls[:3] == ["a", "b", "c"]                       # warm-up, one each
    timed = calls[3:]
    assert timed[:3] == ["a", "b", "c"] and timed[3:6] == ["b", "c", "a"]  # rotating order
    assert isinstance(res["c"], RuntimeError)
    assert len(res["a"]) == 4 and len(res["b"]) == 4


@pytest.mark.skipif(not HAVE_EXPORTER, reason="needs the exporter")
def test_eager_block_runs_the_exported_weights(tmp_path):
    """torch-eager and onnxruntime-cpu rows must time the same model: the eager block is the
    exporter's build_attention of the exported sidecar, the inputs ModelInfo.make_inputs."""
    import onnxruntime as ort

    cfg = bench.Config(sizes=[64], batches=[2], dtype="float32", heads=2, head_dim=32,
                       text_len=8, iters=1, warmup=0, device="cpu", seed=3)
    info = bench._export_onnx(cfg, tmp_path / "a.onnx")
    block = bench._make_block(cfg, info)
    hs, ehs, caches, mask = bench._make_inputs(cfg, info, 64, 2)
    with torch.no_grad():
        img, txt = block(hs, ehs, caches, mask)
    feeds = bench._make_feeds(cfg, info, 64, 2)
    sess = ort.InferenceSession(str(tmp_path / "a.onnx"), providers=["CPUExecutionProvider"])
    ort_img, ort_txt = sess.run(None, feeds)
    assert torch.allclose(img, torch.from_numpy(ort_img), atol=1e-4, rtol=1e-4)
    assert torch.allclose(txt, torch.from_numpy(ort_txt), atol=1e-4, rtol=1e-4)


def test_time_cpu_counts_calls():
    calls = []
    times = measure.time_cpu(lambda: calls.append(1), iters=4, warmup=2)
    assert len(times) == 4 and len(calls) == 6 and all(t >= 0 for t in times)


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
    by = {(r["backend"], r["size"]): r for r in rows}

    # measured: torch eager (and ONNX Runtime when the exporter is present), with the machine
    for size, tokens in ((64, 16), (128, 64)):
        r = by[("torch-eager", size)]
        assert r["status"] == "ok" and r["median_ms"] > 0 and r["img_tokens"] == tokens
        assert r["machine"]["torch"] == torch.__version__ and r["machine"]["cpu"]
        assert "onnxruntime" in r["machine"] and "tensorrt" in r["machine"]
        assert f"| torch-eager | {size} | {tokens} | 8 | 1 | float32 |" in md
        ort = by[("onnxruntime-cpu", size)]
        if not HAVE_EXPORTER:  # the exporter is another module of this project
            assert ort["status"] == "skipped" and "ONNX export failed" in ort["reason"]
            continue
        assert ort["status"] == "ok" and ort["median_ms"] > 0, ort
        assert ort["machine"]["onnxruntime"] not in ("", "not installed")
        assert f"| onnxruntime-cpu | {size} | {tokens} | 8 | 1 | float32 |" in md
    # one CPU thread by default (no --threads), said above the table
    assert {r["machine"]["cpu_threads"] for r in rows if r["status"] == "ok"} == {"1"}
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


def test_plot_with_nothing_measured(tmp_path):
    row = measure.BenchRow("trt-plugin", 512, 1024, 512, 1, "bfloat16", status="skipped",
                    reason=bench.REQUIRES_CUDA)
    p = bench.write_plot([row], tmp_path / "x.png")
    assert p.read_bytes()[:4] == b"\x89PNG"
    assert "- trt-plugin: skipped, requires CUDA" in measure.format_bench_table([row])


def test_bad_arguments_are_one_line_errors(capsys):
    assert cli_main(["bench", "--sizes", "500", "--device", "cpu"]) == 2
    assert "multiple of 16" in capsys.readouterr().err


@pytest.mark.skipif(not HAVE_EXPORTER, reason="needs the exporter")
@pytest.mark.parametrize("case", ["interleaved=5", "no-plugin_namespace"])
def test_bench_checks_its_model_against_the_node_contract(tmp_path, monkeypatch, case):
    """The exported model's QKNormRoPE nodes are validated before ONNX Runtime (or TensorRT)
    opens it: a node outside the contract skips the rows with the attribute named."""
    import onnxruntime as ort
    from _bad_nodes import BAD_NODE_CASES, write_bad_copy
    real_export = bench._export_onnx

    def export_then_break(cfg, path):
        info = real_export(cfg, path)
        good = path.with_name("good.onnx")
        path.rename(good)
        path.with_name(path.name + ".json").rename(good.with_name("good.onnx.json"))
        write_bad_copy(good, path, case)
        return info

    def refuse(*a, **k):
        raise AssertionError("ONNX Runtime opened the model before the contract check")

    monkeypatch.setattr(bench, "_export_onnx", export_then_break)
    monkeypatch.setattr(ort, "InferenceSession", refuse)
    cfg = bench.Config(sizes=[64], batches=[1], dtype="float32", heads=2, head_dim=32,
                       text_len=8, iters=1, warmup=0, device="cpu", seed=0, out=tmp_path)
    rows = bench.run_bench(cfg, log=lambda s: None)
    ort_row = next(r for r in rows if r.backend == "onnxruntime-cpu")
    assert ort_row.status == "skipped" and BAD_NODE_CASES[case][0] in ort_row.reason, ort_row


def test_cuda_device_without_gpu_is_one_line(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli_main(["bench", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA GPU" in err and err.count("\n") == 1
