"""The loads and instructions of a hot loop: the global loads outstanding while the loop runs
(:func:`loads_in_flight`) and at each token's first wait (:func:`first_stall_loads`), the
instruction mix, the global memory accesses, and :func:`analyse_loop`, the hot-loop figures of
one function as a JSON-ready dict."""
from __future__ import annotations

import collections
import re

from .flow import (cold_addresses, common_path_counts, find_hot_loop, longest_path, loop_body,
                   skipped_addresses)
from .instructions import Instr
from .scoreboards import scoreboard_waits, wait_summary

__all__ = ["loads_in_flight", "first_stall_loads", "loads_at_first_wait", "instruction_mix",
           "memory_ops", "analyse_loop", "outstanding_at_waits"]


def loads_in_flight(body: list[Instr]) -> dict:
    """Walk the loop body twice in address order (steady state, so loads issued at the end of
    one iteration and consumed in the next count): a global load is outstanding from its issue
    until the first instruction that reads or overwrites one of its destination registers.
    Returns the maximum outstanding 128-bit q/k loads (non-CONSTANT) and outstanding bytes."""
    outstanding: list[tuple[set[int], int, bool]] = []
    max_qk128 = 0
    max_bytes = 0
    for _ in range(2):
        for ins in body:
            regs = ins.registers()
            outstanding = [o for o in outstanding if not (o[0] & regs)]
            if ins.is_global_load:
                outstanding.append((ins.dest_registers(), ins.width, ins.is_constant))
            max_qk128 = max(max_qk128, sum(1 for o in outstanding if o[1] == 128 and not o[2]))
            max_bytes = max(max_bytes, sum(o[1] // 8 for o in outstanding))
    return {"max_qk_loads_128": max_qk128, "max_bytes_per_thread": max_bytes}



def first_stall_loads(body: list[Instr]) -> list[int]:
    """128-bit q/k loads outstanding at each token's first wait, in the steady state: the loop
    body is walked twice in address order (loads issued in one iteration are consumed in the
    next); a load is outstanding from its issue until the first instruction that reads or
    overwrites its destination registers; a token's first wait is the first such consumption of a
    q/k load after a global store (or the loop head). Returns the count at each of those waits in
    the second walk (one per token of the unrolled loop)."""
    outstanding: list[tuple[set[int], int, bool]] = []
    counts: list[int] = []
    fresh = False
    for walk in range(2):
        fresh = True
        for ins in body:
            regs = ins.registers()
            hit = [o for o in outstanding if o[0] & regs]
            if hit and any(o[1] == 128 and not o[2] for o in hit):
                if fresh and walk == 1:
                    counts.append(sum(1 for o in outstanding if o[1] == 128 and not o[2]))
                fresh = False
            outstanding = [o for o in outstanding if not (o[0] & regs)]
            if ins.is_global_load:
                outstanding.append((ins.dest_registers(), ins.width, ins.is_constant))
            if ins.is_global_store:
                fresh = True
    return counts


_MIX = {
    "SHFL": ("SHFL",),
    "MUFU": ("MUFU",),
    "F2F/F2FP": ("F2F", "F2FP"),
    "FFMA/FMUL/FADD": ("FFMA", "FMUL", "FADD"),
    "BRA": ("BRA",),
    "LDG": ("LDG",),
    "STG": ("STG",),
}


def instruction_mix(body: list[Instr]) -> dict:
    counts = collections.Counter(i.base for i in body if not i.is_nop)
    mix = {k: sum(counts[o] for o in ops) for k, ops in _MIX.items()}
    mix["other"] = sum(counts.values()) - sum(mix.values())
    return {"categories": mix, "opcodes": dict(counts.most_common())}


def memory_ops(instrs: list[Instr]) -> list[dict]:
    """The global memory accesses: loads, stores, and asynchronous copies global -> shared
    (LDGSTS, kind "async": a read of global memory like a load)."""
    def kind(i):
        return "load" if i.is_global_load else "async" if i.base == "LDGSTS" else "store"
    return [{"addr": f"0x{i.addr:04x}", "sass": i.text, "kind": kind(i),
             "width": i.width, "qualifiers": i.qualifiers, "constant": i.is_constant,
             "predicated": i.pred is not None}
            for i in instrs if i.is_global_load or i.is_global_store or i.base == "LDGSTS"]


def analyse_loop(instrs: list[Instr], elem_bytes: int) -> dict:
    """The hot-loop figures of one function (see the module docstring)."""
    loop, ncand = find_hot_loop(instrs)
    if loop is None:
        return {"found": False}
    body = loop_body(instrs, loop)
    real = [i for i in body if not i.is_nop]
    skipped = skipped_addresses(body, loop)
    stores = [i for i in body if i.is_global_store]
    store_bytes = sum(i.width // 8 for i in stores)
    elems = store_bytes / elem_bytes if elem_bytes else 0
    lp = longest_path(body, loop)
    calls = [i.text for i in body if i.base == "CALL"]
    call_targets = [int(h, 16) for i in body if i.base == "CALL"
                    for h in re.findall(r"0x([0-9a-fA-F]+)", i.operands)[-1:]]
    return {
        "found": True,
        "head": f"0x{loop[0]:04x}",
        "end": f"0x{loop[1]:04x}",
        "innermost_candidates": ncand,
        "instructions": len(real),
        "skipped_instructions": sum(1 for i in real if i.addr in skipped),
        "longest_path": lp,
        "stores_128": sum(1 for i in stores if i.width == 128),
        "elements_per_iteration": elems,
        "instr_per_element": (len(real) / elems) if elems else None,
        "longest_path_per_element": (lp / elems) if elems and lp else None,
        "memory_ops": memory_ops(body),
        "mix": instruction_mix(body),
        "calls": calls,
        # the assumption behind the count: the subroutines (cold slow paths) sit outside the loop
        "calls_outside_loop": all(not (loop[0] <= t <= loop[1]) for t in call_targets),
        "in_flight": loads_in_flight(body),
        "first_stall_loads": first_stall_loads(body),
        "common_path": common_path_counts(instrs, loop),
        "scoreboards": _scoreboards(instrs, body, loop),
    }


def _scoreboards(instrs: list[Instr], body: list[Instr], loop: tuple[int, int]) -> dict | None:
    """The waits of the hot loop read from the control bits (scoreboards.scoreboard_waits, the
    common path: cold blocks left out) and their summary; None when the SASS has no encoding."""
    try:
        waits = scoreboard_waits(body, cold_addresses(instrs, loop))
    except ValueError:
        return None
    return {**wait_summary(waits), "waits_list": waits}


def outstanding_at_waits(loop: dict) -> tuple[int | None, float | None]:
    """Global bytes per thread (q/k rows and cos/sin) still outstanding past the hot loop's waits,
    read from the scoreboards: (the fewest at any wait, the average over the loop's waits);
    (None, None) when the SASS carried no control bits."""
    sb = loop.get("scoreboards")
    if not sb:
        return None, None
    return sb["min_outstanding"], sb["avg_outstanding"]


def loads_at_first_wait(loop: dict) -> int:
    """The q/k loads that the design targets count: the fewest outstanding at any token's first
    wait (first_stall_loads); the loop's maximum outstanding where no wait was found."""
    stalls = loop.get("first_stall_loads")
    return min(stalls) if stalls else loop["in_flight"]["max_qk_loads_128"]
