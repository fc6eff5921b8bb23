"""What the hardware waits on: the scoreboards of a loop, read from the control bits of its SASS.

A variable-latency instruction (a global, shared or constant load, S2R, a shuffle, MUFU, ...)
names in its control bits the scoreboard (0-5) that it sets until its result is written; a later
instruction lists in its wait mask the scoreboards that must be clear before it issues, and
``DEPBAR.LE SBk, N`` waits until at most N operations are pending on scoreboard k (the oldest
retire first). Asynchronous copies into shared memory (``LDGSTS``, PTX ``cp.async``) set no
scoreboard themselves: ``LDGDEPBAR`` (``cp.async.commit_group``) closes the copies issued since
the previous one into a group that counts as one operation on its scoreboard, and
``DEPBAR.LE SBk, N`` (``cp.async.wait_group N``) retires all but the N newest groups.

:func:`scoreboard_waits` walks a loop body in address order (the common path: every guarded
block taken, the cold blocks left out) several times, so the steady state is reached, and at
every wait that retires a memory load it records the global bytes still outstanding: pending when
the wait is reached (in flight during the stall) and past it (what the wait leaves in flight: the
floor the loop's bytes in flight fall to). A wait on a scoreboard retires everything on it,
whatever that was issued for: the hardware cannot wait for one load of a scoreboard and leave
the others in flight. This is what the register-based :func:`~.loads.first_stall_loads` does not
see (it counts a load outstanding until its registers are first read).
"""
from __future__ import annotations

import re

from .instructions import Instr

__all__ = ["SCOREBOARDS", "Op", "op_of", "scoreboard_waits", "wait_summary"]

SCOREBOARDS = 6
_DEPBAR_RE = re.compile(r"SB(\d)\s*,\s*(0x[0-9a-fA-F]+|\d+)(?:\s*,\s*\{([\d,\s]*)\})?")

# Op kinds: "qk" (128-bit or narrower global loads without .CONSTANT: the rows), "cache" (global
# loads through the read-only path: cos/sin, weights), "async" (a committed group of LDGSTS copies:
# global reads into shared memory), "shared" (LDS), "other" (no memory read: S2R, SHFL, MUFU, LDC,
# a store's operand read, ...).
GLOBAL_KINDS = ("qk", "cache", "async")
MEMORY_KINDS = GLOBAL_KINDS + ("shared",)


class Op:
    """One operation pending on a scoreboard: its kind and the global bytes it reads."""

    __slots__ = ("kind", "nbytes", "addr")

    def __init__(self, kind: str, nbytes: int, addr: int):
        self.kind, self.nbytes, self.addr = kind, nbytes, addr

    def __repr__(self) -> str:
        return f"Op({self.kind}, {self.nbytes} B, 0x{self.addr:04x})"


def op_of(ins: Instr) -> Op:
    """What a variable-latency instruction's write scoreboard tracks."""
    if ins.is_global_load:
        return Op("cache" if ins.is_constant else "qk", ins.width // 8, ins.addr)
    if ins.base in ("LDS", "LDSM"):
        return Op("shared", 0, ins.addr)
    return Op("other", 0, ins.addr)


def _global_bytes(boards: list[list[Op]], open_copies: int) -> int:
    return open_copies + sum(o.nbytes for ops in boards for o in ops if o.kind in GLOBAL_KINDS)


def scoreboard_waits(body: list[Instr], skip: set[int] | None = None, walks: int = 3) -> list[dict]:
    """The waits of a loop body in its steady state: walk the body `walks` times in address order
    (instructions at addresses in `skip` and NOPs left out) and return, for each wait of the last
    walk that retires at least one memory load (global, shared or an asynchronous-copy group):
    its address, instruction, the scoreboards it waits on, the global bytes pending when it is
    reached (``pending``) and still outstanding past it (``outstanding``), and what it retired.
    Raises ValueError when the body carries no control bits (a listing without the encoding)."""
    skip = skip or set()
    instrs = [i for i in body if i.addr not in skip and not i.is_nop]
    if instrs and all(i.control is None for i in instrs):
        raise ValueError("the SASS carries no control bits (cuobjdump -sass prints them beside "
                         "each instruction)")
    boards: list[list[Op]] = [[] for _ in range(SCOREBOARDS)]
    open_copies = 0      # LDGSTS bytes issued since the last LDGDEPBAR
    waits: list[dict] = []
    for walk in range(walks):
        for ins in instrs:
            ctrl = ins.control
            if ctrl is None:
                continue
            before = _global_bytes(boards, open_copies)
            retired: list[Op] = []
            on = list(ctrl.waits_on())
            for k in on:
                retired += boards[k]
                boards[k] = []
            if ins.base == "DEPBAR":
                m = _DEPBAR_RE.search(ins.operands)
                if m:
                    k, keep = int(m.group(1)), int(m.group(2), 0)
                    on.append(k)
                    if len(boards[k]) > keep:
                        retired += boards[k][:len(boards[k]) - keep]
                        boards[k] = boards[k][len(boards[k]) - keep:]
                    for extra in (m.group(3) or "").split(","):
                        if extra.strip():
                            on.append(int(extra))
                            retired += boards[int(extra)]
                            boards[int(extra)] = []
            if walk == walks - 1 and any(o.kind in MEMORY_KINDS for o in retired):
                waits.append({
                    "addr": ins.addr, "sass": ins.text, "scoreboards": sorted(set(on)),
                    "pending": before, "outstanding": _global_bytes(boards, open_copies),
                    "retired": {kind: sum(1 for o in retired if o.kind == kind)
                                for kind in MEMORY_KINDS if any(o.kind == kind for o in retired)},
                })
            # issue
            if ins.base == "LDGSTS":
                open_copies += ins.width // 8
            if ins.base == "LDGDEPBAR":
                if ctrl.write_sb is not None:
                    boards[ctrl.write_sb].append(Op("async", open_copies, ins.addr))
                open_copies = 0
            elif ctrl.write_sb is not None:
                boards[ctrl.write_sb].append(op_of(ins))
            if ctrl.read_sb is not None:
                boards[ctrl.read_sb].append(Op("other", 0, ins.addr))
    return waits


def wait_summary(waits: list[dict]) -> dict:
    """Per thread: the fewest and the average global bytes outstanding past the waits (and
    pending at them), and the number of waits; None figures when the loop has no wait."""
    if not waits:
        return {"waits": 0, "min_outstanding": None, "avg_outstanding": None,
                "min_pending": None, "avg_pending": None}
    out = [w["outstanding"] for w in waits]
    pend = [w["pending"] for w in waits]
    return {"waits": len(waits), "min_outstanding": min(out), "avg_outstanding": sum(out) / len(out),
            "min_pending": min(pend), "avg_pending": sum(pend) / len(pend)}
