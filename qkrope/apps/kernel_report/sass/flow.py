"""The control flow of one function's SASS: what is reachable from the entry (``BRA.DIV`` not
taken, ``CALL`` targets not entered), its loops (back edges), the hot loop (the innermost loop
with the 128-bit stores and the row reduction's shuffles), the cold code off the common path
(slow-path call blocks, the loops but the hot one) and the longest paths through it: the
instructions one thread executes along the common path."""
from __future__ import annotations

from .instructions import Instr

__all__ = ["reachable", "find_loops", "loop_body", "find_hot_loop", "skipped_addresses",
           "longest_path", "cold_addresses", "common_path_counts"]


def reachable(instrs: list[Instr]) -> set[int]:
    """Addresses reachable from the entry, following fall-through and branch targets; BRA.DIV
    is not taken and CALL targets are not entered (subroutines: cold slow paths)."""
    index = {ins.addr: k for k, ins in enumerate(instrs)}
    seen: set[int] = set()
    todo = [0] if instrs else []
    while todo:
        k = todo.pop()
        if k in seen:
            continue
        seen.add(k)
        ins = instrs[k]
        t = ins.flow_target
        if t is not None and t in index:
            todo.append(index[t])
        if not ins.ends_flow and k + 1 < len(instrs):
            todo.append(k + 1)
    return {instrs[k].addr for k in seen}


def find_loops(instrs: list[Instr]) -> list[tuple[int, int]]:
    """Loops from the control flow: a reachable branch to a lower address is a back edge and
    defines the loop [target, branch]; back edges to the same head merge (the last one ends the
    loop). Out-of-line blocks reached only through BRA.DIV (the diverged-warp fallback of a
    shuffle, which jumps back into the loop) are not reachable and define no loop."""
    live = reachable(instrs)
    ends: dict[int, int] = {}
    for ins in instrs:
        t = ins.flow_target
        if t is not None and t < ins.addr and ins.addr in live:
            ends[t] = max(ends.get(t, t), ins.addr)
    return sorted(ends.items())


def loop_body(instrs: list[Instr], loop: tuple[int, int]) -> list[Instr]:
    return [i for i in instrs if loop[0] <= i.addr <= loop[1]]


def find_hot_loop(instrs: list[Instr], loops: list[tuple[int, int]] | None = None):
    """The innermost loop that contains 128-bit global stores (any global store when the function
    has no 128-bit one) and a shuffle (the row's sum-of-squares reduction: this excludes the
    kernel's rare NaN fix-up loop, which re-stores rows without computing them); among several
    innermost candidates the one with the most such stores.
    Returns (loop or None, number of innermost candidates)."""
    loops = find_loops(instrs) if loops is None else loops
    stores = [i.addr for i in instrs if i.is_global_store and i.width == 128]
    if not stores:
        stores = [i.addr for i in instrs if i.is_global_store]
    shuffles = [i.addr for i in instrs if i.opcode.startswith("SHFL")]
    cands = [lp for lp in loops if any(lp[0] <= a <= lp[1] for a in stores)
             and (not shuffles or any(lp[0] <= a <= lp[1] for a in shuffles))]
    inner = [lp for lp in cands
             if not any(o != lp and lp[0] <= o[0] and o[1] <= lp[1] for o in cands)]
    if not inner:
        return None, 0
    best = max(inner, key=lambda lp: (sum(lp[0] <= a <= lp[1] for a in stores), -lp[0]))
    return best, len(inner)


def skipped_addresses(body: list[Instr], loop: tuple[int, int]) -> set[int]:
    """Addresses inside the loop that some forward branch inside the loop jumps over: the
    instructions not executed on every iteration (if/else arms, guarded blocks)."""
    skipped: set[int] = set()
    for ins in body:
        t = ins.flow_target
        if t is not None and ins.addr < t <= loop[1]:
            skipped.update(i.addr for i in body if ins.addr < i.addr < t)
    return skipped


def longest_path(body: list[Instr], loop: tuple[int, int]) -> int | None:
    """The most non-NOP instructions on one path from the loop head to a back edge (the loop
    body is a DAG once back edges are cut: the loop is innermost). None if no path."""
    n = len(body)
    index = {ins.addr: k for k, ins in enumerate(body)}
    neg = -1
    dist = [neg] * n
    if not n:
        return None
    dist[0] = 0 if body[0].is_nop else 1
    best = None
    for k, ins in enumerate(body):
        if dist[k] == neg:
            continue
        succ = []
        t = ins.flow_target
        if t is not None:
            if t <= ins.addr and t == loop[0]:
                best = dist[k] if best is None else max(best, dist[k])
            elif t > ins.addr and t in index:
                succ.append(index[t])
        if not ins.ends_flow and k + 1 < n:
            succ.append(k + 1)
        for s in succ:
            w = 0 if body[s].is_nop else 1
            dist[s] = max(dist[s], dist[k] + w)
    return best



def _leaders(instrs: list[Instr]) -> set[int]:
    """Indices that start a basic block: the entry, branch targets, and the instruction after a
    branch, CALL, EXIT or RET."""
    index = {ins.addr: k for k, ins in enumerate(instrs)}
    lead = {0} if instrs else set()
    for k, ins in enumerate(instrs):
        t = ins.branch_target
        if t is not None and t in index:
            lead.add(index[t])
        if (ins.is_branch or ins.base in ("CALL", "EXIT", "RET")) and k + 1 < len(instrs):
            lead.add(k + 1)
    return lead


def cold_addresses(instrs: list[Instr], hot: tuple[int, int] | None) -> set[int]:
    """Instructions off the kernel's common path: every basic block that calls a subroutine (the
    IEEE division/square-root slow paths: their argument set-up, the CALL and the return block),
    code reached only through calls (after EXIT), and every loop but the hot loop (the rare NaN
    fix-up, entered only when a row produced a NaN)."""
    live = reachable(instrs)
    cold = {ins.addr for ins in instrs if ins.addr not in live}
    lead = sorted(_leaders(instrs))
    for k, ins in enumerate(instrs):
        if ins.base != "CALL":
            continue
        start = max(x for x in lead if x <= k)
        after = [x for x in lead if x > k + 1]
        stop = after[0] if after else len(instrs)
        cold.update(instrs[j].addr for j in range(start, stop))
    for lp in find_loops(instrs):
        if hot is None or lp != hot:
            cold.update(i.addr for i in instrs if lp[0] <= i.addr <= lp[1])
    return cold


def _longest_forward(instrs: list[Instr], sources: set[int], lo: int, hi: int, cold: set[int],
                     sinks) -> int | None:
    """Most non-NOP instructions on a forward path (back edges cut) that starts at one of the
    indices `sources`, stays inside the address range [lo, hi], avoids `cold`, and ends at an index
    for which sinks(k, ins) is true (that instruction counted). None when no such path."""
    index = {ins.addr: k for k, ins in enumerate(instrs)}
    dist: dict[int, int] = {}
    for k in sorted(sources):
        if instrs[k].addr not in cold:
            dist[k] = 0 if instrs[k].is_nop else 1
    best = None
    for k, ins in enumerate(instrs):
        if k not in dist:
            continue
        if sinks(k, ins):
            best = dist[k] if best is None else max(best, dist[k])
            continue   # a path ends at its first sink (a guarded EXIT too: see common_path_counts)
        succ = []
        t = ins.flow_target
        if t is not None and t > ins.addr and t in index:
            succ.append(index[t])
        if not ins.ends_flow and k + 1 < len(instrs):
            succ.append(k + 1)
        for s in succ:
            nxt = instrs[s]
            if not (lo <= nxt.addr <= hi) or nxt.addr in cold:
                continue
            d = dist[k] + (0 if nxt.is_nop else 1)
            if d > dist.get(s, -1):
                dist[s] = d
    return best


def common_path_counts(instrs: list[Instr], loop: tuple[int, int]) -> dict:
    """Dynamic instruction counts of one thread along the common path (cold_addresses avoided,
    every other guarded block taken, which is what the kernel executes when no slow path and no
    NaN fix-up runs): the prologue (entry to the hot-loop head, exclusive), one hot-loop
    iteration (head to back edge) and the epilogue (loop exit to the first EXIT on the path: the
    kernel's guarded `@P EXIT` after the loop is its common case, no NaN to fix up; what follows
    it sets up the fix-up loop)."""
    cold = cold_addresses(instrs, loop)
    index = {ins.addr: k for k, ins in enumerate(instrs)}
    head, end = index[loop[0]], index[loop[1]]
    last = instrs[-1].addr if instrs else 0
    pro = _longest_forward(instrs, {0}, instrs[0].addr, loop[0], cold, lambda k, i: k == head)
    body = [i for i in instrs if loop[0] <= i.addr <= loop[1]]
    it = longest_path([i for i in body if i.addr not in cold or i.addr == loop[0]], loop)
    exits = set()
    for k in range(head, end + 1):
        ins = instrs[k]
        t = ins.flow_target
        if t is not None and t > loop[1] and t in index:
            exits.add(index[t])
    if not instrs[end].ends_flow and end + 1 < len(instrs):
        exits.add(end + 1)
    epi = _longest_forward(instrs, exits, loop[1] + 1, last, cold,
                           lambda k, i: i.base in ("EXIT", "RET"))
    return {"prologue": None if pro is None else pro - 1, "iteration": it, "epilogue": epi,
            "cold_in_loop": sum(1 for i in body if i.addr in cold and not i.is_nop)}
