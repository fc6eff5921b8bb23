"""``qkrope.apps.bench.orchestrate``: whole runs on the CPU (tiny sizes): the node-contract check
before ONNX Runtime opens the export, thread sets with a real ONNX Runtime profile, the attention
forms (measured, or skipped with the reason), and the GPU branch wired with fake engines."""

from __future__ import annotations

from pathlib import Path

import fake_tensorrt as ft
import pytest
import torch
from _layer_info import _layers

from qkrope.apps import measure
from qkrope.apps.bench import backends, config, orchestrate, ort_profile
from qkrope.apps.bench import rows as bench_rows

try:
    import qkrope.export.onnx_export  # noqa: F401
    HAVE_EXPORTER = True
except ImportError:
    HAVE_EXPORTER = False


@pytest.mark.skipif(not HAVE_EXPORTER, reason="needs the exporter")
@pytest.mark.parametrize("case", ["interleaved=5", "no-plugin_namespace"])
def test_bench_checks_its_model_against_the_node_contract(tmp_path, monkeypatch, case):
    """The exported model's QKNormRoPE nodes are validated before ONNX Runtime (or TensorRT)
    opens it: a node outside the contract skips the rows with the attribute named."""
    import onnxruntime as ort
    from _bad_nodes import BAD_NODE_CASES, write_bad_copy
    real_export = orchestrate._export_onnx

    def export_then_break(cfg, path, **kw):
        info = real_export(cfg, path, **kw)
        good = path.with_name("good.onnx")
        path.rename(good)
        path.with_name(path.name + ".json").rename(good.with_name("good.onnx.json"))
        write_bad_copy(good, path, case)
        return info

    def refuse(*a, **k):
        raise AssertionError("ONNX Runtime opened the model before the contract check")

    monkeypatch.setattr(orchestrate, "_export_onnx", export_then_break)
    monkeypatch.setattr(ort, "InferenceSession", refuse)
    cfg = config.Config(sizes=[64], batches=[1], dtype="float32", heads=2, head_dim=32,
                       text_len=8, iters=1, warmup=0, device="cpu", seed=0, out=tmp_path,
                       attention=["primitive"])
    rows = orchestrate.run_bench(cfg, log=lambda s: None)
    ort_row = next(r for r in rows if r.backend == "onnxruntime-cpu")
    assert ort_row.status == "skipped" and BAD_NODE_CASES[case][0] in ort_row.reason, ort_row


@pytest.mark.skipif(not HAVE_EXPORTER, reason="needs the exporter")
def test_thread_sets_ratio_and_a_real_ort_profile(tmp_path, monkeypatch):
    """Two thread sets, each its own rows (eager and ORT with the same count); the ORT rows
    carry a profile of a real profiled run and their ratio to eager of the same set."""
    import onnx
    import onnxruntime as ort

    threads_before = torch.get_num_threads()
    seen = []
    real_session = backends._ort_session

    def session(cfg, path, threads, **kw):
        seen.append((threads, "profile_prefix" in kw, torch.get_num_threads()))
        return real_session(cfg, path, threads, **kw)

    monkeypatch.setattr(backends, "_ort_session", session)
    cfg = config.Config(sizes=[64], batches=[1], dtype="float32", heads=2, head_dim=32,
                       text_len=8, iters=2, warmup=1, device="cpu", seed=1, out=tmp_path,
                       threads=[1, 2], attention=["primitive"], profile_runs=2)
    rows = orchestrate.run_bench(cfg, log=lambda s: None)
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
    backends._export_onnx(cfg, path)
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
    assert "QKNormRoPE function body" in ort_profile.format_profiles(rows)


def test_onnx23_rows_are_skipped_with_the_reason(monkeypatch, tmp_path):
    """Explicit skips, never silent: the default asks for both forms; a form that cannot run
    leaves rows that say why (ONNX Runtime's reason)."""
    cfg = config.Config(sizes=[64, 128], batches=[1], dtype="float32", heads=2, head_dim=32,
                       text_len=8, iters=1, warmup=0, device="cpu", threads=[1, 2])
    monkeypatch.setattr(orchestrate, "ort_attention23_reason", lambda: "ORT says no")
    assert orchestrate.resolve_forms(cfg) == (["primitive"], {"onnx23": "ORT says no"})
    cfg.attention = ["onnx23"]
    assert orchestrate.resolve_forms(cfg) == ([], {"onnx23": "ORT says no"})
    cfg.attention = ["primitive"]
    assert orchestrate.resolve_forms(cfg) == (["primitive"], {})
    cfg.device, cfg.attention = "cuda", None           # ORT's CPU provider is not asked there
    assert orchestrate.resolve_forms(cfg) == (["primitive", "onnx23"], {})

    # in a run: every (thread set, size) gets its skipped onnx23 row; nothing is exported
    monkeypatch.setattr(orchestrate, "ort_attention23_reason", lambda: "ORT says no")
    monkeypatch.setattr(orchestrate, "_export_onnx", lambda *a, **k: (_ for _ in ()).throw(
        RuntimeError("export disabled in this test")))
    cfg = config.Config(sizes=[64, 128], batches=[1], dtype="float32", heads=2, head_dim=32,
                       text_len=8, iters=1, warmup=0, device="cpu", threads=[1, 2], out=tmp_path)
    rows = orchestrate.run_bench(cfg, log=lambda s: None)
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
def test_onnx23_form_runs_under_ort_with_its_attention_node(tmp_path, monkeypatch):
    """Both forms by default where they run: one export each (the onnx23 one at opset 23 with
    Attention nodes), one ORT row each, and ORT's profile of the onnx23 rows shows its
    Attention kernel."""
    import onnx

    if backends.ort_attention23_reason():
        pytest.skip(backends.ort_attention23_reason())
    real = backends.aggregate_ort_profile
    monkeypatch.setattr(backends, "aggregate_ort_profile", lambda ev, **kw: real(ev, **{**kw,
                                                                                    "top": 99}))
    exported = []
    real_export = orchestrate._export_onnx

    def export(cfg, path, **kw):
        exported.append((path.name, kw))
        return real_export(cfg, path, **kw)

    monkeypatch.setattr(orchestrate, "_export_onnx", export)
    keep = tmp_path / "keep"
    real_session = backends._ort_session

    def session(cfg, path, threads, **kw):
        keep.mkdir(exist_ok=True)
        (keep / path.name).write_bytes(Path(path).read_bytes())
        return real_session(cfg, path, threads, **kw)

    monkeypatch.setattr(backends, "_ort_session", session)
    cfg = config.Config(sizes=[64], batches=[1], dtype="float32", heads=2, head_dim=32,
                       text_len=8, iters=2, warmup=1, device="cpu", out=tmp_path,
                       profile_runs=1)
    rows = orchestrate.run_bench(cfg, log=lambda s: None)
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

    def fake_load(path, plugin=None, cuda_graph=False, allow_host_code=False):
        loaded.append((Path(path).name, plugin))
        return Runner(path, plugin)

    cpu_inputs = backends._make_inputs
    monkeypatch.setattr(orchestrate, "_have_tensorrt", lambda: True)
    monkeypatch.setattr(orchestrate, "_build_engines", fake_build)
    monkeypatch.setattr(runtime, "load", fake_load)
    monkeypatch.setattr(backends, "_make_inputs", lambda cfg, info, size, batch: cpu_inputs(
        config.Config(**{**cfg.__dict__, "device": "cpu"}), info, size, batch))
    monkeypatch.setattr(orchestrate, "_torch_backends", lambda *a, **k: {
        ("torch-eager", "sdpa"): lambda size, batch: (lambda: None)})
    monkeypatch.setattr(bench_rows, "time_interleaved", lambda calls, **kw:
                        measure.time_interleaved(calls, iters=kw["iters"], warmup=kw["warmup"],
                                                 cuda=False))
    monkeypatch.setattr(orchestrate, "_bench_kernel", lambda cfg, rows, machine: None)
    cfg = config.Config(sizes=[64], batches=[1], dtype="float32", heads=2, head_dim=32,
                       text_len=8, iters=2, warmup=0, device="cuda", out=tmp_path,
                       plugin="/x/libqkrope_plugin.so", attention=["primitive"])
    real_export = orchestrate._export_onnx
    monkeypatch.setattr(orchestrate, "_export_onnx", lambda cfg, path, attention="primitive":
                        real_export(cfg, path))                 # both forms as the primitive one
    cfg.attention = ["primitive", "onnx23"]
    rows = orchestrate.run_bench(cfg, log=lambda s: None)
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
