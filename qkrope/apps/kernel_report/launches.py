"""The real launcher against modelled devices: ``qknorm_rope.cu`` under the SIMT emulation, in
dry-run mode (nothing computed), planning every family record's launches on each device of
MODELLED_DEVICES with each instance's occupancy from its ptxas registers; the figures of the
instance each launch picks, and the static targets (LAUNCH_TARGETS) they are checked against."""
from __future__ import annotations

import math
import os

from .assumptions import (MODELLED_DEVICES, STEADY_TOKENS_PER_GROUP, TARGET_ARCHS, THRESHOLDS,
                          device_hardware, launch_problems, launch_target, occupancy)
from .instances import label_of
from .sass import ToolError, outstanding_at_waits
from .text import fmt


def launch_figures(inst: dict, launch: dict, problem: dict, occ: dict) -> dict:
    """What one launch of `inst` does per thread along the common path: tokens per row group,
    whole-kernel instructions per element (one loop iteration per tokens-per-iteration, plus the
    prologue and epilogue amortised over the group's tokens), and the global read bytes (q/k rows,
    cos/sin) still outstanding per SM past the waits of the steady-state token loop, read from the
    SASS scoreboards: the fewest at any wait x resident threads (the target's figure) and the
    average over the loop's waits."""
    loop = inst["hot_loop"]
    common = loop.get("common_path") or {}
    roles = inst["roles"]
    rows = int(roles.get("rows", 1))
    eb = inst["elem_bytes"]
    vec = 16 // eb
    head_dim = int(roles.get("head_dim", problem["head_dim"]))
    lanes = min(head_dim // vec, 32)
    elems = head_dim // lanes
    if inst["kind"] == "row":
        return _row_figures(loop, common, rows, elems, lanes, launch, problem, occ)
    units = 2 * math.ceil(problem["heads"] / rows)
    token_step = launch["grid"][0] * (256 // lanes) // units
    tokens_per_group = problem["tokens"] / token_step
    per_iter = loop["elements_per_iteration"] / (rows * elems)   # tokens per loop iteration
    it, pro, epi = common.get("iteration"), common.get("prologue"), common.get("epilogue")
    ipe = None
    if it and pro is not None and epi is not None:
        ipe = (tokens_per_group * it / per_iter + pro + epi) / (tokens_per_group * rows * elems)
    least, average = outstanding_at_waits(loop)
    threads = occ["threads_per_sm"]
    return {"rows": rows, "grid": launch["grid"][0], "token_step": token_step,
            "tokens_per_group": tokens_per_group, "instr_per_element": ipe,
            "loop_instr_per_element": it / loop["elements_per_iteration"] if it else None,
            "prologue": pro, "epilogue": epi, "bytes_outstanding_per_thread": least,
            "bytes_in_flight_per_sm": (least or 0) * threads,
            "avg_bytes_in_flight_per_sm": (average or 0) * threads, "threads_per_sm": threads,
            "blocks_per_sm": occ["blocks_per_sm"]}


def row_threads(heads: int, rows: int, lanes: int) -> int:
    """The row kernel's block size (qknorm_rope_plan.h rowThreads): groups of `lanes` threads
    owning `rows` heads each, rounded up to whole warps."""
    return math.ceil(math.ceil(heads / rows) * lanes / 32) * 32


def _row_figures(loop, common, rows, elems, lanes, launch, problem, occ) -> dict:
    """launch_figures for the norm_scope 1 row kernel: a block of launch["block"] threads owns a
    token's q or k row; every thread issues the loop (idle rows past num_heads included), so the
    instructions per element are the block's over the row's heads x head_dim elements; the bytes
    outstanding per thread are scaled by the share of rows that are real (idle rows are not
    copied, though their predicated copies are in the SASS)."""
    threads_per_block = launch["block"][0]
    token_step = launch["grid"][0] // 2
    tokens_per_block = problem["tokens"] / token_step
    per_iter = loop["elements_per_iteration"] / (rows * elems)
    it, pro, epi = common.get("iteration"), common.get("prologue"), common.get("epilogue")
    row_elems = problem["heads"] * problem["head_dim"]
    ipe = None
    if it and pro is not None and epi is not None:
        ipe = ((tokens_per_block * it / per_iter + pro + epi) * threads_per_block
               / (tokens_per_block * row_elems))
    least, average = outstanding_at_waits(loop)
    real = problem["heads"] / (threads_per_block // lanes * rows)
    threads = occ["threads_per_sm"]
    return {"rows": rows, "grid": launch["grid"][0], "token_step": token_step,
            "threads_per_block": threads_per_block,
            "tokens_per_group": tokens_per_block, "instr_per_element": ipe,
            "loop_instr_per_element": (it * threads_per_block / (per_iter * row_elems)) if it else None,
            "prologue": pro, "epilogue": epi, "bytes_outstanding_per_thread": least,
            "bytes_in_flight_per_sm": (least or 0) * threads * real,
            "avg_bytes_in_flight_per_sm": (average or 0) * threads * real, "threads_per_sm": threads,
            "blocks_per_sm": occ["blocks_per_sm"]}


def plan_launches(report: dict, simt_lib: str | None = None,
                  problems: list[dict] | None = None) -> list[dict]:
    """Run the real launcher (qknorm_rope.cu under the SIMT emulation, dry run: nothing computed)
    against each modelled device for each family's launch and its rounding modes
    (assumptions.launch_problems), with each instance's
    occupancy from the ptxas registers of the build for that device's architecture (sm_90's where
    that architecture was not compiled), and analyse the instance it launches. The library:
    ``simt_lib``, else where the toolchain's rule finds it (``$QKROPE_KERNELS_SIMT_LIB``,
    build/plugins, build/kernel, build/kernel-simt). ``problems``: launch_problems()'s dicts to
    plan instead of the family records' launches."""
    from qkrope.runtime import kernels
    saved = os.environ.get(kernels.SIMT_LIB_ENV)
    if simt_lib:
        os.environ[kernels.SIMT_LIB_ENV] = simt_lib  # for the loader only: restored below
    try:
        if kernels.simt_library_path() is None:
            raise ToolError("the SIMT emulation library is not built: " + kernels.SIMT_BUILD_COMMAND)
        return _plan_launches(report, kernels, problems)
    finally:
        if saved is None:
            os.environ.pop(kernels.SIMT_LIB_ENV, None)
        else:
            os.environ[kernels.SIMT_LIB_ENV] = saved


def _plan_launches(report: dict, kernels, problems: list[dict] | None = None) -> list[dict]:
    import torch

    entries = {int(a): e for a, e in report["archs"].items()}
    if not entries:
        return []
    symbols = kernels.simt_kernel_symbols("qkNormRope")
    simt_names = {}
    for name in symbols:
        if name.startswith("void ") and "lambda" not in name:
            label = label_of(name)
            if label:
                simt_names[label] = name
    launches = []
    for dev_name, dev in MODELLED_DEVICES.items():
        arch = dev["arch"] if dev["arch"] in entries else (90 if 90 in entries else min(entries))
        by_label = {i["label"]: i for i in entries[arch]["instances"]}
        hw = device_hardware(dev_name)
        occ = {label: occupancy(i["regs"], i["smem"], i["threads_per_block"], hw) for label, i in by_label.items()}
        table = {simt_names[label]: o["blocks_per_sm"] for label, o in occ.items() if label in simt_names}

        def configure(table):
            kernels.simt_configure_model(num_sms=dev["sms"], max_threads_per_sm=dev["max_threads_per_sm"],
                                         compute_capability=dev["cc"], clock_khz=dev["clock_khz"],
                                         mem_clock_khz=dev["mem_clock_khz"], bus_width_bits=dev["bus_width_bits"],
                                         occupancy=table, dry_run=True)
        configure(table)
        try:
            for prob in (launch_problems() if problems is None else problems):
                scope = prob.get("norm_scope", 0)
                if scope == 1:
                    # the row kernel's occupancy at the block size this head count gives it
                    occ = dict(occ)
                    for label, i in by_label.items():
                        if i["kind"] == "row":
                            lanes = min(int(i["roles"]["head_dim"]) * i["elem_bytes"] // 16, 32)
                            t = row_threads(prob["heads"], int(i["roles"]["rows"]), lanes)
                            occ[label] = occupancy(i["regs"], i["smem"], t, hw)
                    configure({simt_names[label]: o["blocks_per_sm"] for label, o in occ.items()
                               if label in simt_names})
                # dry run: the tensors are never read, only their shapes and pointers planned
                q = torch.empty(prob["batch"], prob["seq"], prob["heads"], prob["head_dim"],
                                dtype=torch.bfloat16)
                k = torch.empty_like(q)
                w = torch.ones(prob["head_dim"] * (prob["heads"] if scope == 1 else 1),
                               dtype=torch.bfloat16)
                cache = torch.zeros(prob["seq"], prob["rotary_dim"])
                for rounding in prob["roundings"]:
                    kernels.simt_reset()
                    kernels.simt_qk_norm_rope(q, k, w, w, cache, interleaved=prob["interleaved"],
                                              rounding=rounding, norm_scope=scope,
                                              out=(q, k))
                    recs = kernels.simt_last_launches()
                    if len(recs) != 1:
                        raise ToolError(f"{dev_name}, {prob['model']} {prob['stream']}: expected one "
                                        f"launch, got {len(recs)}")
                    label = label_of(recs[0]["kernel"])
                    inst = by_label.get(label)
                    row = {"device": dev_name, "arch": arch, "model": prob["model"], "heads": prob["heads"],
                           "stream": prob["stream"], "batch": prob["batch"], "tokens": prob["tokens"],
                           "rounding": rounding, "norm_scope": scope, "instance": label,
                           "found": inst is not None}
                    if inst is not None and inst["hot_loop"].get("found"):
                        row.update(launch_figures(inst, recs[0], prob, occ[label]))
                    launches.append(row)
        finally:
            kernels.simt_configure(dry_run=False)
    return launches


def launch_checks(launches: list[dict]) -> list[dict]:
    """The static targets (LAUNCH_TARGETS) for every launch on a TARGET_ARCHS device; a launch
    whose groups walk fewer than STEADY_TOKENS_PER_GROUP tokens is held to THRESHOLDS on its
    token loop instead of the whole-kernel instruction target."""
    checks = []
    for ln in launches:
        if ln["arch"] not in TARGET_ARCHS or MODELLED_DEVICES[ln["device"]]["arch"] not in TARGET_ARCHS:
            continue
        t = launch_target(ln["tokens"])
        where = (f"{ln['device']}, {ln['model']} {ln['stream']}, batch {ln['batch']}, "
                 f"rounding {ln['rounding']}")
        if not ln["found"] or "instr_per_element" not in ln:
            checks.append({"check": "launched-instance", "arch": ln["arch"], "instance": str(ln["instance"]),
                           "ok": False, "detail": f"{where}: the launched instance is not in the SASS"})
            continue
        need_b, have_b = t["bytes_in_flight_per_sm"], ln["bytes_in_flight_per_sm"]
        checks.append({"check": "launched-bytes-in-flight", "arch": ln["arch"], "instance": ln["instance"],
                       "ok": have_b >= need_b,
                       "detail": f"{where}: {have_b / 1024:.1f} KiB per SM outstanding past every wait "
                                 f"(scoreboards: {fmt(ln['bytes_outstanding_per_thread'])} B x "
                                 f"{ln['threads_per_sm']} threads; average "
                                 f"{ln['avg_bytes_in_flight_per_sm'] / 1024:.1f} KiB) "
                                 f"{'>=' if have_b >= need_b else '<'} {need_b // 1024} KiB"})
        steady = ln["tokens_per_group"] >= STEADY_TOKENS_PER_GROUP
        if steady:
            lim, ipe, what = t["instr_per_element"][ln["rounding"]], ln["instr_per_element"], ""
        else:   # the ring's fill only: the loop's per-token figure (STEADY_TOKENS_PER_GROUP)
            lim, ipe = THRESHOLDS[ln["rounding"]], ln["loop_instr_per_element"]
            what = " in the token loop (fewer tokens per group than the ring holds)"
        ok = ipe is not None and ipe <= lim
        checks.append({"check": "launched-instr-per-element", "arch": ln["arch"], "instance": ln["instance"],
                       "ok": ok, "detail": f"{where}: {fmt(ipe, '.2f')} {'<=' if ok else '>'} {lim} "
                                           f"instructions per element{what} "
                                           f"({ln['tokens_per_group']:.1f} tokens per group)"})
    return checks
