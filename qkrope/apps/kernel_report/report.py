"""The report as one dict: compile (or take the given cubins), analyse every instance, run the
real launcher against the modelled devices, and check the structural facts that must not drift
(``--check``)."""
from __future__ import annotations

from pathlib import Path

from .assumptions import PROBLEM, THRESHOLD_SOURCE, THRESHOLDS
from .instances import BUILD_DIR, DEFAULT_ARCHS, SOURCE, analyse_cubin, compile_cubins
from .launches import launch_checks, plan_launches
from .sass import ToolError, Tools

def structural_checks(instances: list[dict]) -> list[dict]:
    """The facts that must not drift. One entry per (check, instance): name, label, arch, ok, detail."""
    checks = []

    def add(name, inst, ok, detail):
        checks.append({"check": name, "arch": inst["arch"], "instance": inst["label"], "ok": bool(ok),
                       "detail": detail})

    for inst in instances:
        # every instance, both paths: a spill is local memory traffic in a memory-bound kernel
        spills = (inst["spill_stores"] or 0) + (inst["spill_loads"] or 0)
        local = inst["local"] or 0
        ok = spills == 0 and local == 0 and not inst["local_memory_sass"]
        add("no-spills", inst, ok,
            f"spill stores/loads {inst['spill_stores']}/{inst['spill_loads']} B, local {inst['local']} B, "
            f"LDL/STL in SASS: {len(inst['local_memory_sass'])}")
        if inst["kind"] not in ("fast", "row"):
            continue
        loop = inst["hot_loop"]
        if not loop.get("found"):
            add("qk-128bit", inst, False, "no hot loop with global stores found")
        else:
            ops = loop["memory_ops"]
            # q/k reads: 128-bit loads into registers or asynchronous copies into shared memory
            loads = [o for o in ops if o["kind"] in ("load", "async") and not o["constant"]]
            stores = [o for o in ops if o["kind"] == "store"]
            bad = [o["sass"] for o in loads + stores if o["width"] != 128]
            missing = [w for w, lst in (("q/k load", loads), ("store", stores)) if not lst]
            detail = (f"{len(loads)} q/k loads, {len(stores)} stores in the hot loop"
                      + (f"; narrower: {bad}" if bad else "") + (f"; no {missing}" if missing else ""))
            add("qk-128bit", inst, not bad and not missing, detail)
        add("store-default-policy", inst, not inst["store_policies"],
            "STG qualifiers " + (",".join(inst["store_policies"]) if inst["store_policies"] else "default"))
        if inst["reference"]:
            # one loop iteration along the common path (slow-path call blocks excluded) per element:
            # what every token costs; the launched-* checks add the amortised prologue/epilogue
            ipe = None
            if loop.get("found"):
                it = (loop.get("common_path") or {}).get("iteration")
                ipe = it / loop["elements_per_iteration"] if it and loop["elements_per_iteration"] else \
                    loop.get("instr_per_element")
            th = inst["threshold"]
            ok = ipe is not None and th is not None and ipe <= th
            note = (f"rounding={inst['rounding']}" if inst["rounding"] is not None
                    else "runtime rounding: both paths in the loop, the rounding=0 threshold")
            add("instr-per-element", inst, ok,
                f"{ipe:.2f} {'<=' if ok else '>'} {th} per element ({note})" if ipe is not None
                else "no instruction count")
    return checks


def build_report(archs: list[int] | None = None, *, cubins: list[str] | None = None,
                 nvcc: str | None = None, cuobjdump: str | None = None, nvdisasm: str | None = None,
                 source: Path = SOURCE, out_dir: Path = BUILD_DIR, launches: bool = True,
                 simt_lib: str | None = None) -> dict:
    """Compile (or take the given cubins), analyse, run the real launcher against the modelled
    devices (``launches``; needs the SIMT emulation library), check. The whole report as one dict."""
    tools = Tools(nvcc=nvcc, cuobjdump=cuobjdump, nvdisasm=nvdisasm, need_nvcc=not cubins)
    source = Path(source)
    source_text = source.read_text() if source.is_file() else None
    report: dict = {"tool": "scripts/kernel_report.py", "source": str(source),
                    "tools": {"nvcc": tools.nvcc, "cuobjdump": tools.cuobjdump,
                              "nvdisasm": tools.nvdisasm, "c++filt": tools.cxxfilt},
                    "thresholds": {str(k): v for k, v in THRESHOLDS.items()},
                    "threshold_source": THRESHOLD_SOURCE, "problem": PROBLEM, "archs": {}}
    if cubins:
        for c in cubins:
            if not Path(c).is_file():
                raise ToolError(f"cubin not found: {c}")
            res = analyse_cubin(Path(c), tools, source_text=source_text, archs=archs)
            for arch, entry in res.items():
                entry["cubin"] = str(c)
                report["archs"][str(arch)] = entry
    else:
        built = compile_cubins(list(archs or DEFAULT_ARCHS), tools.nvcc, source, out_dir)
        for arch, (cubin, log) in built.items():
            res = analyse_cubin(cubin, tools, ptxas_log=log, source_text=source_text, archs=[arch])
            if arch not in res:
                raise ToolError(f"no sm_{arch} SASS in {cubin}")
            res[arch]["cubin"] = str(cubin)
            report["archs"][str(arch)] = res[arch]
    all_instances = [i for e in report["archs"].values() for i in e["instances"]]
    report["checks"] = structural_checks(all_instances)
    if launches:
        report["launches"] = plan_launches(report, simt_lib)
        report["checks"] += launch_checks(report["launches"])
    report["ok"] = all(c["ok"] for c in report["checks"])
    return report
