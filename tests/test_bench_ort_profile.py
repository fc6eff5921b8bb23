"""``qkrope.apps.bench.ort_profile``: ONNX Runtime's per-op profile read from a trace, its
summary, and the ratio of ONNX Runtime to torch eager in the same thread set."""

from __future__ import annotations

import pytest

from qkrope.apps import measure
from qkrope.apps.bench import ort_profile


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
    prof = ort_profile.aggregate_ort_profile(ev, runs=2, graph_nodes={"node_matmul", "node_softmax"},
                                       functions=["QKNormRoPE"], top=2)
    assert prof["runs"] == 2 and prof["total_us"] == pytest.approx(100.0)
    assert prof["run_us"] == pytest.approx(900.0)
    assert [(o["op"], o["us_per_run"], o["nodes"]) for o in prof["top_ops"]] == \
        [("MatMul", 60.0, 1), ("FusedMatMul", 20.0, 1), ("(2 other op types)", 20.0, 3)]
    assert sum(o["share_pct"] for o in prof["top_ops"]) == pytest.approx(100.0)
    groups = {g["group"]: (g["us_per_run"], g["nodes"]) for g in prof["groups"]}
    assert groups == {ort_profile.REST_OF_GRAPH: (84.0, 3), "QKNormRoPE function body": (16.0, 2)}
    # a graph node that happens to look like a nameless one stays in the graph
    assert ort_profile.classify_profiled_node("Mul_3", "Mul", graph_nodes={"Mul_3"},
                                        functions=["F"]) == ort_profile.REST_OF_GRAPH
    assert ort_profile.classify_profiled_node("Mul_3", "Add", functions=["F"]) == ort_profile.REST_OF_GRAPH
    assert ort_profile.classify_profiled_node("Add_9", "Add", functions=["F", "G"]) == \
        "inlined functions function body"
    assert ort_profile.classify_profiled_node("_inlfunc_G_token_1_x", "Add", functions=["F", "G"]) == \
        "G function body"
    assert "MatMul 60.0%" in ort_profile.profile_summary(prof)
    assert "QKNormRoPE function body 16.0% (2 nodes)" in ort_profile.profile_summary(prof)


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
    ort_profile.attach_ratios(rows)
    assert rows[2].ort_vs_eager == pytest.approx(1.2) and "ONNX Runtime slower" in rows[2].note
    assert "MatMul 100.0%" in rows[2].note
    assert rows[3].ort_vs_eager == pytest.approx(0.5) and "no slower" in rows[3].note
    assert rows[4].ort_vs_eager is None and rows[5].ort_vs_eager is None
    assert rows[0].ort_vs_eager is None
    assert "| 1.20 |" in measure.format_bench_table(rows)
