"""ONNX Runtime's per-op profile of the ``onnxruntime-cpu`` rows, from the trace that
``end_profiling()`` writes: kernel time per op type and per group (the inlined QKNormRoPE
function body apart from the rest of the graph), its one-line summary, ONNX Runtime's ratio to
torch eager in the same thread set, and the profile section of ``bench.md``. Pure; the profiled
session itself is :func:`qkrope.apps.bench.backends.profile_ort`."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Collection, Mapping, Sequence

from ..measure import BenchRow


#: the group of the inlined function bodies' nodes in :func:`aggregate_ort_profile`
REST_OF_GRAPH = "rest of the graph"


def _body_group(functions: Sequence[str], name: str | None = None) -> str:
    if name is None:
        name = functions[0] if len(functions) == 1 else "inlined functions"
    return f"{name} function body"


def classify_profiled_node(name: str, op: str, *, graph_nodes: Collection[str] = (),
                           functions: Sequence[str] = ()) -> str:
    """The group of one profiled node: ``"<Function> function body"`` or :data:`REST_OF_GRAPH`.

    What an ONNX Runtime trace looks like (1.31, checked on the exported block): ORT inlines a
    model-local function (QKNormRoPE has no kernel there) before optimising. The inlined nodes
    keep the body's node names prefixed with ``_inlfunc_<Function>[_token_<n>]_``, and the
    body's value names are prefixed the same way; a body node without a name (models exported
    before the body's nodes were named) comes out nameless, and the profiler names a nameless
    node ``<OpType>_<index>``
    (``Mul_121``). Every node of the exported graph itself has a name (the torch exporter's
    ``node_...``), which ORT keeps, or extends with a ``/<Fusion>/`` suffix when it fuses nodes
    (``node_matmul/MatMulScaleFusion/``). So a node is in a function body when its name has
    the ``_inlfunc_`` prefix, or is ``<its op type>_<digits>`` and not a node name of the
    exported graph; anything else (the graph's nodes, nodes ORT's optimisers made) is the
    rest of the graph."""
    if name.startswith("_inlfunc_"):
        for f in sorted(functions, key=len, reverse=True):
            if name.startswith(f"_inlfunc_{f}"):
                return _body_group(functions, f)
        return _body_group(functions, name[len("_inlfunc_"):].split("_", 1)[0] or None)
    if name in graph_nodes or name.split("/", 1)[0] in graph_nodes:
        return REST_OF_GRAPH
    if re.fullmatch(re.escape(op) + r"_\d+", name):
        return _body_group(functions)
    return REST_OF_GRAPH


def aggregate_ort_profile(events: Sequence[Mapping[str, Any]], *, runs: int | None = None,
                          graph_nodes: Collection[str] = (), functions: Sequence[str] = (),
                          top: int = 8) -> dict:
    """Per-op-type kernel time of an ONNX Runtime profile (the list ``end_profiling()`` wrote).

    The ``"Node"`` events named ``<node>_kernel_time`` are the kernels (older releases also
    write ``_fence_before/after`` events; they are left out). Only those inside the last
    ``runs`` ``model_run`` events count (so the warm-up runs before them do not); times are per
    run. Returns ``{"runs", "total_us" (kernel time per run), "run_us" (mean model_run time,
    which adds the executor's own overhead), "top_ops": [{"op", "us_per_run", "share_pct",
    "nodes"}] (the ``top`` largest op types, then one ``"(N other op types)"`` entry, so the
    shares add up to 100), "groups": [the same by :func:`classify_profiled_node`]}``."""
    windows = [(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in events
               if e.get("cat") == "Session" and e.get("name") == "model_run"]
    if runs is not None and 0 < runs < len(windows):
        windows = windows[-runs:]
    nodes = [e for e in events if e.get("cat") == "Node"]
    kernels = [e for e in nodes if str(e.get("name", "")).endswith("_kernel_time")] or nodes
    if windows:
        kernels = [e for e in kernels
                   if any(a <= float(e.get("ts", -1)) <= b for a, b in windows)]
    n_runs = len(windows) or (runs or 1)
    by_op: dict[str, list] = {}
    by_group: dict[str, list] = {}
    for e in kernels:
        name = str(e.get("name", ""))
        if name.endswith("_kernel_time"):
            name = name[: -len("_kernel_time")]
        op = str((e.get("args") or {}).get("op_name") or name)
        dur = float(e.get("dur", 0))
        group = classify_profiled_node(name, op, graph_nodes=graph_nodes, functions=functions)
        for table, key in ((by_op, op), (by_group, group)):
            acc = table.setdefault(key, [0.0, set()])
            acc[0] += dur
            acc[1].add(name)
    total = sum(v[0] for v in by_op.values())

    def entries(table: dict, key: str, limit: int | None) -> list[dict]:
        ranked = sorted(table.items(), key=lambda kv: (-kv[1][0], kv[0]))
        keep, rest = (ranked, []) if limit is None else (ranked[:limit], ranked[limit:])
        out = [{key: k, "us_per_run": v[0] / n_runs,
                "share_pct": 100.0 * v[0] / total if total else 0.0, "nodes": len(v[1])}
               for k, v in keep]
        if rest:
            dur = sum(v[0] for _, v in rest)
            out.append({key: f"({len(rest)} other op types)", "us_per_run": dur / n_runs,
                        "share_pct": 100.0 * dur / total if total else 0.0,
                        "nodes": sum(len(v[1]) for _, v in rest)})
        return out

    run_us = (sum(b - a for a, b in windows) / len(windows)) if windows else None
    return {"runs": n_runs, "total_us": total / n_runs, "run_us": run_us,
            "top_ops": entries(by_op, "op", top), "groups": entries(by_group, "group", None)}


def profile_summary(profile: Mapping[str, Any] | None, *, ops: int = 4) -> str:
    """One line: the top op types with their share, the function-body group, the totals."""
    if not profile:
        return "no profile"
    tops = [o for o in profile.get("top_ops", []) if not str(o["op"]).startswith("(")][:ops]
    text = ", ".join(f"{o['op']} {o['share_pct']:.1f}%" for o in tops)
    bodies = [g for g in profile.get("groups", []) if g["group"] != REST_OF_GRAPH]
    for g in bodies:
        text += f"; {g['group']} {g['share_pct']:.1f}% ({g['nodes']} nodes)"
    run = profile.get("run_us")
    text += (f"; kernels {profile['total_us'] / 1e3:.1f} ms per run"
             + (f" of {run / 1e3:.1f} ms" if run else "")
             + f" ({profile['runs']} profiled run{'s' * (profile['runs'] != 1)})")
    return text


def graph_names(onnx_path: Path) -> tuple[set[str], list[str]]:
    """(the node names of the model's main graph, its model-local functions' names), for
    :func:`classify_profiled_node`."""
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    return {n.name for n in model.graph.node if n.name}, [f.name for f in model.functions]


def attach_ratios(rows: Sequence[BenchRow]) -> None:
    """Set ``ort_vs_eager`` (ONNX Runtime median / torch-eager median of the same thread set,
    size, batch and dtype) on every measured ``onnxruntime-*`` row, and a note saying whether
    ONNX Runtime is no slower than eager; where it is slower the note names the top ops of the
    row's profile."""
    eager = {(r.threads, r.size, r.batch, r.dtype): r for r in rows
             if r.backend == "torch-eager" and r.status == "ok" and r.median_ms}
    for r in rows:
        if not r.backend.startswith("onnxruntime") or r.status != "ok" or not r.median_ms:
            continue
        e = eager.get((r.threads, r.size, r.batch, r.dtype))
        if e is None:
            continue
        r.ort_vs_eager = r.median_ms / e.median_ms
        if r.ort_vs_eager <= 1.0:
            verdict = f"ONNX Runtime no slower than torch eager ({r.ort_vs_eager:.2f}x)"
        else:
            verdict = (f"ONNX Runtime slower than torch eager ({r.ort_vs_eager:.2f}x); "
                       f"profile: {profile_summary(r.profile)}")
        r.note = f"{r.note}; {verdict}" if r.note else verdict


def format_profiles(rows: Sequence[BenchRow]) -> str:
    """One line per profiled ONNX Runtime row: its top ops and the function-body group."""
    lines = []
    for r in rows:
        if r.profile is None:
            continue
        what = (f"error: {r.profile['error']}" if "error" in r.profile
                else profile_summary(r.profile))
        ratio = f" [{r.ort_vs_eager:.2f}x eager]" if r.ort_vs_eager is not None else ""
        lines.append(f"- {r.attention}, {r.threads} thread(s), {r.size} px, batch {r.batch}"
                     f"{ratio}: {what}")
    return "\n".join(["ONNX Runtime profile (kernel time by op type, share of all kernels):", ""]
                     + lines) if lines else ""
