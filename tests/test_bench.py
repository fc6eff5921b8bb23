"""``qkrope bench``: pure helpers and the CPU path (tiny sizes, a few seconds)."""

from __future__ import annotations

import json
from pathlib import Path

import fake_tensorrt as ft
import onnx
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
    assert set(bench.DTYPE_CHOICES) == {"fp32", "fp16", "bf16"}  # export's spellings


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

    def export_then_break(cfg, path, **kw):
        info = real_export(cfg, path, **kw)
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
                       text_len=8, iters=1, warmup=0, device="cpu", seed=0, out=tmp_path,
                       attention=["primitive"])
    rows = bench.run_bench(cfg, log=lambda s: None)
    ort_row = next(r for r in rows if r.backend == "onnxruntime-cpu")
    assert ort_row.status == "skipped" and BAD_NODE_CASES[case][0] in ort_row.reason, ort_row


def test_cuda_device_without_gpu_is_one_line(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli_main(["bench", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA GPU" in err and err.count("\n") == 1


# --------------------------------------------------------------------------------------------
# issue 12 part 3: thread sets, attention forms, ONNX Runtime's profile, TensorRT's inspector
# --------------------------------------------------------------------------------------------

def test_parse_threads_and_forms(monkeypatch):
    monkeypatch.setattr(bench.os, "sched_getaffinity", lambda pid: {0, 1, 2, 5}, raising=False)
    assert bench.available_threads() == 4
    assert bench.parse_threads("1,all") == [1, 4]
    assert bench.parse_threads("all,1") == [4, 1]
    assert bench.parse_threads("2, 1, 2") == [2, 1]          # each count once, order kept
    assert bench.parse_threads("1,ALL,4") == [1, 4]
    assert bench.parse_threads(3) == [3] and bench.parse_threads([1, "all"]) == [1, 4]
    for bad in ("0", "1,x", "", ",", "-2", "1.5"):
        with pytest.raises(ValueError, match="--threads"):
            bench.parse_threads(bad)
    monkeypatch.setattr(bench.os, "sched_getaffinity", lambda pid: {0}, raising=False)
    assert bench.parse_threads("1,all") == [1]                 # one CPU: one set
    assert bench.parse_attention_forms("onnx23, primitive") == ["onnx23", "primitive"]
    assert bench.parse_attention_forms("primitive,primitive") == ["primitive"]
    for bad in ("", "sdpa", "primitive,onnx22"):
        with pytest.raises(ValueError, match="--attention"):
            bench.parse_attention_forms(bad)


def test_thread_counts_of_a_config():
    cfg = bench.Config(sizes=[64], batches=[1], dtype="float32", heads=2, head_dim=32,
                       text_len=8, iters=1, warmup=0, device="cpu")
    assert bench.thread_counts(cfg) == [1]
    cfg.threads = [2, 1]
    assert bench.thread_counts(cfg) == [2, 1] and bench.cpu_threads(cfg) == 2
    cfg.threads, cfg.device = None, "cuda:0"
    assert bench.thread_counts(cfg) == [None]


def test_preset_qwen_and_flags_over_it(monkeypatch):
    from qkrope import cli

    monkeypatch.setattr(bench.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    parser = cli.build_parser()
    cfg = bench.config_from_args(parser.parse_args(["bench", "--preset", "qwen", "--device",
                                                    "cpu"]))
    assert (cfg.heads, cfg.head_dim, cfg.sizes, cfg.text_len, cfg.batches) == \
        (24, 128, [256, 512], 128, [1])
    assert (cfg.dtype, cfg.threads, cfg.iters, cfg.warmup) == ("float32", [1, 2], 5, 2)
    assert cfg.attention is None and cfg.profile_runs == 3
    cfg = bench.config_from_args(parser.parse_args(
        ["bench", "--preset", "qwen", "--device", "cpu", "--heads", "2", "--threads", "1",
         "--warmup", "0", "--attention", "primitive", "--profile-runs", "0"]))
    assert (cfg.heads, cfg.head_dim, cfg.threads, cfg.warmup) == (2, 128, [1], 0)
    assert cfg.attention == ["primitive"] and cfg.profile_runs == 0
    # without a preset: the small CPU defaults of the quick path
    cfg = bench.config_from_args(parser.parse_args(["bench", "--device", "cpu"]))
    assert (cfg.heads, cfg.head_dim, cfg.sizes, cfg.text_len, cfg.threads) == \
        (2, 64, [256], 64, None)
    with pytest.raises(ValueError, match="--threads"):
        bench.config_from_args(parser.parse_args(["bench", "--device", "cpu", "--threads",
                                                  "0"]))


def _event(name, op, ts, dur, cat="Node"):
    return {"cat": cat, "name": name, "ts": ts, "dur": dur, "ph": "X",
            "args": {"op_name": op, "provider": "CPUExecutionProvider"}}


def test_aggregate_ort_profile_on_a_small_trace():
    """Per-op sums per run over the last `runs` model_run windows only (the warm-up run
    before them is left out), fence events ignored, the function body grouped apart."""
    ev = [_event("model_run", "", 0, 100, cat="Session")]           # warm-up run
    ev += [_event("node_matmul_kernel_time", "MatMul", 10, 999)]
    for t0 in (1000, 2000):                                         # two profiled runs
        ev.append(_event("model_run", "", t0, 900, cat="Session"))
        ev.append(_event("node_matmul_kernel_time", "MatMul", t0 + 1, 60))
        ev.append(_event("node_matmul_fence_before", "MatMul", t0 + 1, 500))
        ev.append(_event("node_matmul/MatMulScaleFusion/_kernel_time", "FusedMatMul",
                         t0 + 2, 20))
        ev.append(_event("Mul_121_kernel_time", "Mul", t0 + 3, 10))  # nameless body node
        ev.append(_event("_inlfunc_QKNormRoPE_token_0_sq_kernel_time", "Mul", t0 + 4, 6))
        ev.append(_event("node_softmax_kernel_time", "Softmax", t0 + 5, 4))
    prof = bench.aggregate_ort_profile(ev, runs=2, graph_nodes={"node_matmul", "node_softmax"},
                                       functions=["QKNormRoPE"], top=2)
    assert prof["runs"] == 2 and prof["total_us"] == pytest.approx(100.0)
    assert prof["run_us"] == pytest.approx(900.0)
    assert [(o["op"], o["us_per_run"], o["nodes"]) for o in prof["top_ops"]] == \
        [("MatMul", 60.0, 1), ("FusedMatMul", 20.0, 1), ("(2 other op types)", 20.0, 3)]
    assert sum(o["share_pct"] for o in prof["top_ops"]) == pytest.approx(100.0)
    groups = {g["group"]: (g["us_per_run"], g["nodes"]) for g in prof["groups"]}
    assert groups == {bench.REST_OF_GRAPH: (84.0, 3), "QKNormRoPE function body": (16.0, 2)}
    # a graph node that happens to look like a nameless one stays in the graph
    assert bench.classify_profiled_node("Mul_3", "Mul", graph_nodes={"Mul_3"},
                                        functions=["F"]) == bench.REST_OF_GRAPH
    assert bench.classify_profiled_node("Mul_3", "Add", functions=["F"]) == bench.REST_OF_GRAPH
    assert bench.classify_profiled_node("Add_9", "Add", functions=["F", "G"]) == \
        "inlined functions function body"
    assert bench.classify_profiled_node("_inlfunc_G_token_1_x", "Add", functions=["F", "G"]) == \
        "G function body"
    assert "MatMul 60.0%" in bench.profile_summary(prof)
    assert "QKNormRoPE function body 16.0% (2 nodes)" in bench.profile_summary(prof)


@pytest.mark.skipif(not HAVE_EXPORTER, reason="needs the exporter")
def test_thread_sets_ratio_and_a_real_ort_profile(tmp_path, monkeypatch):
    """Two thread sets, each its own rows (eager and ORT with the same count); the ORT rows
    carry a profile of a real profiled run and their ratio to eager of the same set."""
    import onnx
    import onnxruntime as ort

    threads_before = torch.get_num_threads()
    seen = []
    real_session = bench._ort_session

    def session(cfg, path, threads, **kw):
        seen.append((threads, "profile_prefix" in kw, torch.get_num_threads()))
        return real_session(cfg, path, threads, **kw)

    monkeypatch.setattr(bench, "_ort_session", session)
    cfg = bench.Config(sizes=[64], batches=[1], dtype="float32", heads=2, head_dim=32,
                       text_len=8, iters=2, warmup=1, device="cpu", seed=1, out=tmp_path,
                       threads=[1, 2], attention=["primitive"], profile_runs=2)
    rows = bench.run_bench(cfg, log=lambda s: None)
    assert torch.get_num_threads() == threads_before
    # a timed and a separate profiled session per set, torch on the set's count meanwhile
    assert seen == [(1, False, 1), (1, True, 1), (2, False, 2), (2, True, 2)]
    ok = [r for r in rows if r.status == "ok"]
    assert sorted((r.backend, r.threads) for r in ok) == [
        ("onnxruntime-cpu", 1), ("onnxruntime-cpu", 2), ("torch-eager", 1), ("torch-eager", 2)]
    eager = {r.threads: r for r in ok if r.backend == "torch-eager"}
    ort_rows = [r for r in ok if r.backend == "onnxruntime-cpu"]
    assert all(r.attention == "primitive" for r in ort_rows)
    assert all(r.machine["cpu_threads"] == str(r.threads) for r in ok)

    # the op types ORT ran: those of its optimised model of the same file
    path = tmp_path / "m.onnx"
    bench._export_onnx(cfg, path)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.optimized_model_filepath = str(tmp_path / "opt.onnx")
    ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    opt = onnx.load(str(tmp_path / "opt.onnx"))
    ran = {n.op_type for n in opt.graph.node}
    # the inlined body's nodes: named after the body's (prefixed _inlfunc_), or nameless
    nameless = sum(1 for n in opt.graph.node if not n.name or n.name.startswith("_inlfunc_"))
    for r in ort_rows:
        assert r.ort_vs_eager == pytest.approx(r.median_ms / eager[r.threads].median_ms)
        assert ("ONNX Runtime slower" in r.note) == (r.ort_vs_eager > 1.0), r.note
        if r.ort_vs_eager > 1.0:
            assert r.profile["top_ops"][0]["op"] in r.note
        prof = r.profile
        assert prof["runs"] == 2 and prof["threads"] == r.threads and prof["total_us"] > 0
        assert sum(o["share_pct"] for o in prof["top_ops"]) == pytest.approx(100.0, abs=1e-6)
        assert sum(o["us_per_run"] for o in prof["top_ops"]) == pytest.approx(prof["total_us"])
        shares = [o["share_pct"] for o in prof["top_ops"] if not o["op"].startswith("(")]
        assert shares == sorted(shares, reverse=True)
        named = {o["op"] for o in prof["top_ops"] if not o["op"].startswith("(")}
        assert named and named <= ran, named - ran
        assert sum(o["nodes"] for o in prof["top_ops"]) <= len(opt.graph.node)
        groups = {g["group"]: g for g in prof["groups"]}
        body = groups["QKNormRoPE function body"]
        assert body["nodes"] == nameless > 0 and 0 < body["share_pct"] < 100
        assert sum(g["share_pct"] for g in prof["groups"]) == pytest.approx(100.0)
    md = measure.format_bench_table(rows)
    assert "CPU threads (torch, ONNX Runtime): 1, 2" in md
    assert "| onnxruntime-cpu | primitive | 2 | 64 |" in md and "| torch-eager | sdpa | 1 | 64 |" in md
    assert "QKNormRoPE function body" in bench.format_profiles(rows)


def test_attach_ratios_pairs_rows_of_the_same_set():
    def row(backend, threads, median, **kw):
        return measure.BenchRow(backend, 256, 256, 128, 1, "float32", median_ms=median,
                                threads=threads, **kw)

    rows = [row("torch-eager", 1, 10.0), row("torch-eager", 2, 6.0),
            row("onnxruntime-cpu", 1, 12.0, attention="primitive",
                profile={"runs": 1, "total_us": 1.0, "run_us": None, "groups": [],
                         "top_ops": [{"op": "MatMul", "us_per_run": 1.0, "share_pct": 100.0,
                                      "nodes": 3}]}),
            row("onnxruntime-cpu", 2, 3.0, attention="onnx23"),
            row("onnxruntime-cpu", 4, 3.0, attention="primitive"),       # no eager at 4
            row("onnxruntime-cpu", 1, None, attention="onnx23", status="skipped",
                reason="why")]
    bench.attach_ratios(rows)
    assert rows[2].ort_vs_eager == pytest.approx(1.2) and "ONNX Runtime slower" in rows[2].note
    assert "MatMul 100.0%" in rows[2].note
    assert rows[3].ort_vs_eager == pytest.approx(0.5) and "no slower" in rows[3].note
    assert rows[4].ort_vs_eager is None and rows[5].ort_vs_eager is None
    assert rows[0].ort_vs_eager is None
    assert "| 1.20 |" in measure.format_bench_table(rows)


def test_onnx23_rows_are_skipped_with_the_reason(monkeypatch, tmp_path):
    """Explicit skips, never silent: the default asks for both forms; a form that cannot run
    leaves rows that say why (ONNX Runtime's reason)."""
    cfg = bench.Config(sizes=[64, 128], batches=[1], dtype="float32", heads=2, head_dim=32,
                       text_len=8, iters=1, warmup=0, device="cpu", threads=[1, 2])
    monkeypatch.setattr(bench, "ort_attention23_reason", lambda: "ORT says no")
    assert bench.resolve_forms(cfg) == (["primitive"], {"onnx23": "ORT says no"})
    cfg.attention = ["onnx23"]
    assert bench.resolve_forms(cfg) == ([], {"onnx23": "ORT says no"})
    cfg.attention = ["primitive"]
    assert bench.resolve_forms(cfg) == (["primitive"], {})
    cfg.device, cfg.attention = "cuda", None           # ORT's CPU provider is not asked there
    assert bench.resolve_forms(cfg) == (["primitive", "onnx23"], {})

    # in a run: every (thread set, size) gets its skipped onnx23 row; nothing is exported
    monkeypatch.setattr(bench, "ort_attention23_reason", lambda: "ORT says no")
    monkeypatch.setattr(bench, "_export_onnx", lambda *a, **k: (_ for _ in ()).throw(
        RuntimeError("export disabled in this test")))
    cfg = bench.Config(sizes=[64, 128], batches=[1], dtype="float32", heads=2, head_dim=32,
                       text_len=8, iters=1, warmup=0, device="cpu", threads=[1, 2], out=tmp_path)
    rows = bench.run_bench(cfg, log=lambda s: None)
    skipped = [r for r in rows if r.attention == "onnx23"]
    assert sorted((r.threads, r.size) for r in skipped) == [(1, 64), (1, 128), (2, 64), (2, 128)]
    assert all(r.status == "skipped" and r.reason == "ORT says no" for r in skipped)
    prim = [r for r in rows if r.backend == "onnxruntime-cpu" and r.attention == "primitive"]
    assert len(prim) == 4 and all(r.status == "skipped" and "export disabled" in r.reason
                                  for r in prim)
    assert all(r.reason for r in rows if r.status != "ok")
    assert "- onnxruntime-cpu (onnx23): skipped, ORT says no (4 rows)" in \
        measure.format_bench_table(rows)


@pytest.mark.skipif(not HAVE_EXPORTER, reason="requires the exporter's dependencies")
def test_ort_probe_of_opset23_attention_agrees_with_the_export(tmp_path, monkeypatch):
    """The probe says "" exactly when ONNX Runtime runs a real onnx23 export (bool text mask
    with padding), and a reason naming ONNX Runtime's version when its session fails."""
    import onnxruntime as ort

    from qkrope.export.onnx_export import export_attention
    from qkrope.runtime.inputs import make_inputs

    info, _ = export_attention(tmp_path / "a.onnx", heads=2, head_dim=16, attention="onnx23")
    feeds = make_inputs(info, [(1, 3, 3)], 5, 2, seed=0)
    feeds["encoder_hidden_states_mask"][0, -2:] = False
    try:
        ort.InferenceSession(str(tmp_path / "a.onnx"),
                             providers=["CPUExecutionProvider"]).run(None, feeds)
        runs = True
    except Exception:  # noqa: BLE001
        runs = False
    assert (bench.ort_attention23_reason() == "") == runs

    def refuse(*a, **k):
        raise RuntimeError("no kernel for Attention(23)")

    monkeypatch.setattr(ort, "InferenceSession", refuse)
    reason = bench.ort_attention23_reason()
    assert ort.__version__ in reason and "no kernel for Attention(23)" in reason


_LAYER = {"Name": "x", "LayerType": "CaskGemmMatrixMultiply", "Inputs": [], "Outputs": [],
          "TacticName": "sm90_xmma_gemm_bf16bf16_bf16f32", "Metadata": ""}


def _layers(*layers):
    return json.dumps({"Layers": [dict(_LAYER, **l) if isinstance(l, dict) else l
                                  for l in layers], "Bindings": ["hidden_states"]})


SPAN = ("node_softmax",)  # the model's Softmax node (attention_span_nodes of the export)


@pytest.mark.parametrize("info, want, basis", [
    # a fused MHA kernel as a layer's tactic
    (_layers({"Name": "q_proj"}, {"Name": "_gemm_mha_v2_myl0_3", "LayerType": "kgen",
                                  "TacticName": "fmha_v2_flash_attention_bf16_64_64_S_128_sm90"}),
     "yes", "fmha_v2_flash_attention"),
    # an IAttention layer holding the span node, its kernel not named: inferred only
    (_layers({"Name": "attn", "LayerType": "Attention", "TacticName": "",
              "Metadata": "[ONNX Layer: node_softmax]"}), "likely", "IAttention layer"),
    # the softmax inside a Myelin region: inferred only
    (_layers({"Name": "{ForeignNode[node_matmul...node_matmul_1]}", "LayerType": "Myelin",
              "TacticName": "", "Metadata": "[ONNX Layer: node_matmul]\u001f"
                                            "[ONNX Layer: node_softmax]\u001f"
                                            "[ONNX Layer: node_matmul_1]"}),
     "likely", "Myelin region"),
    # a Myelin region whose metadata names a node called ...attention..., not the span node
    (_layers({"Name": "{ForeignNode[node_linear...node_attention_out]}", "LayerType": "Myelin",
              "TacticName": "", "Metadata": "[ONNX Layer: node_attention_out]"}),
     "unknown", "no attention kernel"),
    # the softmax as its own layer: BMM1, Softmax, BMM2 apart
    (_layers({"Name": "node_matmul"}, {"Name": "node_softmax", "LayerType": "CaskSoftMax",
                                       "TacticName": "0x3e8"}, {"Name": "node_matmul_1"}),
     "no", "its own layer"),
    # a Myelin region elsewhere and a separate softmax: not fused
    (_layers({"Name": "{ForeignNode[node_view...node_linear]}", "LayerType": "Myelin",
              "TacticName": "", "Metadata": "[ONNX Layer: node_linear]"},
             {"Name": "node_softmax", "LayerType": "SoftMax", "TacticName": ""}),
     "no", "node_softmax"),
    # layer names only (no DETAILED verbosity), nothing said
    (json.dumps({"Layers": ["node_matmul", "node_add", "node_matmul_1"]}), "unknown",
     "names only"),
    # names only, a separate softmax named
    (json.dumps({"Layers": ["node_matmul", "node_softmax", "node_matmul_1"]}), "no",
     "node_softmax"),
    # an ONNX node *named* attention is no evidence of a fused kernel
    (_layers({"Name": "node_attention_out", "Metadata": "[ONNX Layer: node_attention_out]"}),
     "unknown", "no attention kernel"),
    (json.dumps({"Layers": []}), "unknown", "no layers"),
])
def test_fused_attention_from_inspector(info, want, basis):
    got, why = bench.fused_attention_from_inspector(info, SPAN)
    assert got == want and basis in why, why
    assert want in bench.VERDICTS
    # a dict reads the same as its JSON text
    assert bench.fused_attention_from_inspector(json.loads(info), SPAN)[0] == want


def test_attention_span_nodes_of_both_forms(tmp_path):
    """The span nodes are the export's Softmax (primitive) or Attention (onnx23) nodes."""
    from qkrope.export.onnx_export import export_attention

    for form, op in (("primitive", "Softmax"), ("onnx23", "Attention")):
        path = tmp_path / f"{form}.onnx"
        export_attention(path, heads=2, head_dim=16, attention=form)
        nodes = bench.attention_span_nodes(path)
        graph = onnx.load(str(path)).graph
        assert nodes and nodes == [n.name for n in graph.node if n.op_type == op], form


def test_engine_inspector_of_a_runner(tmp_path):
    """_inspect_engine asks the engine's inspector (the fake TensorRT's, with the real calls)
    for JSON layer information and writes it out; unreadable information is a reason."""
    trt, _ = ft.make_fake_trt()
    engine = trt.ICudaEngine(layer_info=_layers({"Name": "node_softmax",
                                                 "LayerType": "SoftMax"}))
    runner = type("R", (), {"engine": engine, "trt": trt})()
    fused, basis = bench._inspect_engine(runner, tmp_path / "layers.json")
    assert fused == "no" and "node_softmax" in basis
    assert json.loads((tmp_path / "layers.json").read_text())["Layers"][0]["Name"] == \
        "node_softmax"
    assert bench._inspect_engine(object()) == ("unknown", "the runner exposes no TensorRT "
                                                          "engine to inspect")
    broken = trt.ICudaEngine(layer_info="not json")
    runner = type("R", (), {"engine": broken, "trt": trt})()
    assert bench._inspect_engine(runner)[0] == "unknown"
    assert "unreadable inspector JSON" in bench._inspect_engine(runner)[1]


def test_engines_are_built_per_form_no_plugin_first(tmp_path, monkeypatch):
    """_build_engines: every form's no-plugin engine before any plugin engine (the plugin must
    not be registered yet), given engines not rebuilt, failures as reasons."""
    from qkrope.runtime import engine as E

    built, seen_options = [], []

    def fake_build(onnx_path, engine_path, opts):
        built.append((Path(onnx_path).name, Path(engine_path).name, opts.use_plugin))
        seen_options.append({"profiling_verbosity": opts.profiling_verbosity})
        if "onnx23" in str(engine_path) and opts.use_plugin:
            raise RuntimeError("parser: no importer for Attention")

    monkeypatch.setattr(E, "build_engine", fake_build)
    cfg = bench.Config(sizes=[256, 512], batches=[1], dtype="bfloat16", heads=2, head_dim=32,
                       text_len=8, iters=1, warmup=0, device="cuda")
    paths = {"primitive": tmp_path / "attention.primitive.onnx",
             "onnx23": tmp_path / "attention.onnx23.onnx"}
    out = bench._build_engines(cfg, paths, tmp_path, lambda s: None,
                               skip={("trt-plugin", "primitive")})
    assert built == [("attention.primitive.onnx", "attention.primitive.noplugin.engine", False),
                     ("attention.onnx23.onnx", "attention.onnx23.noplugin.engine", False),
                     ("attention.onnx23.onnx", "attention.onnx23.engine", True)]
    assert out[("trt-function-body", "onnx23")][0].endswith("attention.onnx23.noplugin.engine")
    path, reason = out[("trt-plugin", "onnx23")]
    assert path is None and "no importer for Attention" in reason
    assert ("trt-plugin", "primitive") not in out
    assert all(kw["profiling_verbosity"] == "detailed" for kw in seen_options)


def test_build_options_profiling_verbosity_reaches_the_builder_config(tmp_path, monkeypatch):
    """BuildOptions.profiling_verbosity sets config.profiling_verbosity (the fake TensorRT of
    tests/fake_tensorrt.py); unset, the config keeps TensorRT's default (LAYER_NAMES_ONLY); a
    bad value is refused before TensorRT is asked."""
    import io
    import sys

    from _tiny_model import parse_tiny, write_tiny_onnx

    from qkrope.runtime import engine as E
    from qkrope.runtime import loader_tensorrt as lt

    trt, state = ft.make_fake_trt(parse=parse_tiny)
    monkeypatch.setitem(sys.modules, "tensorrt", trt)
    monkeypatch.setattr(lt.ctypes, "CDLL", lambda path, mode=0: None)
    lib = tmp_path / "libqkrope_plugin.so"
    lib.write_bytes(b"\x7fELF fake")
    onnx_path = write_tiny_onnx(tmp_path / "m.onnx")
    E.build_engine(onnx_path, tmp_path / "a.engine",
                   E.BuildOptions(plugin=str(lib), progress=False,
                                  profiling_verbosity="detailed"), log=io.StringIO())
    assert state.config.profiling_verbosity == trt.ProfilingVerbosity.DETAILED
    E.build_engine(onnx_path, tmp_path / "b.engine",
                   E.BuildOptions(plugin=str(lib), progress=False), log=io.StringIO())
    assert state.config.profiling_verbosity == trt.ProfilingVerbosity.LAYER_NAMES_ONLY  # default
    with pytest.raises(E.EngineBuildError, match="profiling_verbosity"):
        E.check_options(E.BuildOptions(profiling_verbosity="loud"))


@pytest.mark.skipif(not HAVE_EXPORTER, reason="requires the exporter's dependencies")
def test_onnx23_form_runs_under_ort_with_its_attention_node(tmp_path, monkeypatch):
    """Both forms by default where they run: one export each (the onnx23 one at opset 23 with
    Attention nodes), one ORT row each, and ORT's profile of the onnx23 rows shows its
    Attention kernel."""
    import onnx

    if bench.ort_attention23_reason():
        pytest.skip(bench.ort_attention23_reason())
    real = bench.aggregate_ort_profile
    monkeypatch.setattr(bench, "aggregate_ort_profile", lambda ev, **kw: real(ev, **{**kw,
                                                                                    "top": 99}))
    exported = []
    real_export = bench._export_onnx

    def export(cfg, path, **kw):
        exported.append((path.name, kw))
        return real_export(cfg, path, **kw)

    monkeypatch.setattr(bench, "_export_onnx", export)
    keep = tmp_path / "keep"
    real_session = bench._ort_session

    def session(cfg, path, threads, **kw):
        keep.mkdir(exist_ok=True)
        (keep / path.name).write_bytes(Path(path).read_bytes())
        return real_session(cfg, path, threads, **kw)

    monkeypatch.setattr(bench, "_ort_session", session)
    cfg = bench.Config(sizes=[64], batches=[1], dtype="float32", heads=2, head_dim=32,
                       text_len=8, iters=2, warmup=1, device="cpu", out=tmp_path,
                       profile_runs=1)
    rows = bench.run_bench(cfg, log=lambda s: None)
    assert exported == [("attention.primitive.onnx", {"attention": "primitive"}),
                        ("attention.onnx23.onnx", {"attention": "onnx23"})]
    m23 = onnx.load(str(keep / "attention.onnx23.onnx"))
    assert {o.version for o in m23.opset_import if o.domain in ("", "ai.onnx")} == {23}
    assert any(n.op_type == "Attention" for n in m23.graph.node)
    by = {r.attention: r for r in rows if r.backend == "onnxruntime-cpu"}
    assert set(by) == {"primitive", "onnx23"}
    assert all(r.status == "ok" and r.ort_vs_eager is not None for r in by.values())
    ops = {o["op"] for o in by["onnx23"].profile["top_ops"]}
    assert "Attention" in ops and "Softmax" not in ops
    assert "Softmax" in {o["op"] for o in by["primitive"].profile["top_ops"]}


@pytest.mark.skipif(not HAVE_EXPORTER, reason="needs the exporter")
def test_gpu_path_wiring_with_fake_engines(tmp_path, monkeypatch):
    """The GPU branch without a GPU: engines (faked) per form, with and without the plugin,
    each row carrying its form and its inspector verdict; a failed build is a skipped row with
    the build's reason. Timing runs on the CPU timer here (no CUDA events)."""
    from qkrope import runtime

    built = {}

    def fake_build(cfg, paths, workdir, log, skip=()):
        built["forms"] = list(paths)
        out = {}
        for form in paths:
            for b in ("trt-function-body", "trt-plugin"):
                eng = workdir / f"attention.{form}.{b}.engine"
                eng.write_bytes(b"fake")
                out[(b, form)] = (str(eng), "")
        out[("trt-plugin", "onnx23")] = (None, "engine build failed: no Attention importer")
        return out

    layers = {"trt-function-body": {"Name": "node_softmax", "LayerType": "SoftMax"},
              "trt-plugin": {"Name": "{ForeignNode[node_matmul...node_matmul_1]}",
                             "LayerType": "Myelin", "Metadata": "[ONNX Layer: node_softmax]"}}

    class Runner:
        def __init__(self, path, plugin):
            self.path, self.plugin = path, plugin
            backend = "trt-plugin" if ".trt-plugin." in path else "trt-function-body"
            self.trt, _ = ft.make_fake_trt()
            self.engine = self.trt.ICudaEngine(layer_info=_layers(layers[backend]))

        def __call__(self, *args):
            return args[0]

    loaded = []

    def fake_load(path, plugin=None, cuda_graph=False):
        loaded.append((Path(path).name, plugin))
        return Runner(path, plugin)

    cpu_inputs = bench._make_inputs
    monkeypatch.setattr(bench, "_have_tensorrt", lambda: True)
    monkeypatch.setattr(bench, "_build_engines", fake_build)
    monkeypatch.setattr(runtime, "load", fake_load)
    monkeypatch.setattr(bench, "_make_inputs", lambda cfg, info, size, batch: cpu_inputs(
        bench.Config(**{**cfg.__dict__, "device": "cpu"}), info, size, batch))
    monkeypatch.setattr(bench, "_torch_backends", lambda *a, **k: {
        ("torch-eager", "sdpa"): lambda size, batch: (lambda: None)})
    monkeypatch.setattr(bench, "time_interleaved", lambda calls, **kw: measure.time_interleaved(
        calls, iters=kw["iters"], warmup=kw["warmup"], cuda=False))
    monkeypatch.setattr(bench, "_bench_kernel", lambda cfg, rows, machine: None)
    cfg = bench.Config(sizes=[64], batches=[1], dtype="float32", heads=2, head_dim=32,
                       text_len=8, iters=2, warmup=0, device="cuda", out=tmp_path,
                       plugin="/x/libqkrope_plugin.so", attention=["primitive"])
    real_export = bench._export_onnx
    monkeypatch.setattr(bench, "_export_onnx", lambda cfg, path, attention="primitive":
                        real_export(cfg, path))                 # both forms as the primitive one
    cfg.attention = ["primitive", "onnx23"]
    rows = bench.run_bench(cfg, log=lambda s: None)
    assert built["forms"] == ["primitive", "onnx23"]
    trt_rows = {(r.backend, r.attention): r for r in rows if r.backend.startswith("trt")}
    assert set(trt_rows) == {("trt-function-body", "primitive"), ("trt-plugin", "primitive"),
                             ("trt-function-body", "onnx23"), ("trt-plugin", "onnx23")}
    for form in ("primitive", "onnx23"):
        fb = trt_rows[("trt-function-body", form)]
        assert fb.status == "ok" and fb.fused_attention == "no" and "own layer" in fb.note
    p = trt_rows[("trt-plugin", "primitive")]
    assert p.status == "ok" and p.fused_attention == "likely"
    assert "Myelin" in p.fused_attention_basis
    s = trt_rows[("trt-plugin", "onnx23")]
    assert s.status == "skipped" and "no Attention importer" in s.reason
    assert ("attention.primitive.trt-plugin.engine", "/x/libqkrope_plugin.so") in loaded
    assert ("attention.primitive.trt-function-body.engine", None) in loaded
    assert (tmp_path / next(p.name for p in tmp_path.iterdir() if p.is_dir())
            / "layers.trt-plugin.primitive.json").exists()          # kept with the engines
    assert not [r for r in rows if r.backend == "onnxruntime-cpu"]   # no ORT rows on a GPU
    md = measure.format_bench_table(rows)
    assert "| trt-plugin | primitive |" in md and "fused attention: likely" in md


def test_cuda_graph_reaches_the_tensorrt_rows(monkeypatch):
    """`qkrope bench --cuda-graph`: the engines are loaded with cuda_graph=True."""
    import argparse

    from qkrope import runtime

    ap = argparse.ArgumentParser()
    bench.add_parser(ap.add_subparsers())
    args = ap.parse_args(["bench", "--device", "cpu", "--cuda-graph"])
    cfg = bench.config_from_args(args)
    assert cfg.cuda_graph is True
    assert bench.config_from_args(ap.parse_args(["bench", "--device", "cpu"])).cuda_graph is False
    seen = {}

    class Stop(Exception):
        pass

    def fake_load(path, **kw):
        seen.update(kw)
        raise Stop

    monkeypatch.setattr(runtime, "load", fake_load)
    with pytest.raises(Stop):
        bench._engine_backend(cfg, "trt-plugin", "primitive", "m.engine", "p.so", None, {})
    assert seen == {"plugin": "p.so", "cuda_graph": True}
