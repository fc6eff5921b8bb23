"""SASS instructions as ``cuobjdump -sass`` prints them: :class:`Instr` (address, guard predicate,
opcode and modifiers, operands, access width, registers read or written) and :func:`parse_sass`
(the listing -> instructions per function, in address order)."""
from __future__ import annotations

import re

__all__ = ["CONSTANT_QUALIFIER", "STORE_POLICY_QUALIFIERS", "GLOBAL_LOADS", "GLOBAL_STORES",
           "LOCAL_OPS", "Instr", "parse_sass"]

# SASS facts the checks rely on (verified on nvcc 13.0 SASS for sm_90 and sm_100):
#   __ldcs (ld.global.cs)  -> LDG.E.EF.128       __ldg (ld.global.nc) -> LDG.E.CONSTANT (32-bit)
#   plain 128-bit load     -> LDG.E.128                                   LDG.E.128.CONSTANT
#   __stcs (st.global.cs)  -> STG.E.EF.128       plain 128-bit store  -> STG.E.128
# ".E" is the 64-bit address form, ".CONSTANT" the read-only (non-coherent) path: loads with it
# are weights and the cos/sin cache, loads without it are q/k.
CONSTANT_QUALIFIER = "CONSTANT"
STORE_POLICY_QUALIFIERS = ("EF", "EL", "LU", "NA")  # cache hints that are not the default policy
GLOBAL_LOADS = ("LDG", "LD")   # LD: generic address space (may be global)
GLOBAL_STORES = ("STG", "ST")
LOCAL_OPS = ("LDL", "STL")

_INSTR_RE = re.compile(r"^\s*/\*([0-9a-fA-F]{4,})\*/\s*(.*?)\s*;")
_REG_RE = re.compile(r"(?<![\w.])R(\d+)(\.64|\.128)?")
_PRED_RE = re.compile(r"^(@!?U?P(?:T|\d+))\s+(.*)$")


class Instr:
    """One SASS instruction: address, guard predicate, opcode with modifiers, operands."""

    __slots__ = ("addr", "pred", "opcode", "operands", "text", "base", "mods", "_regs")

    def __init__(self, addr: int, text: str):
        self.addr = addr
        self.text = text
        m = _PRED_RE.match(text)
        self.pred, body = (m.group(1), m.group(2)) if m else (None, text)
        parts = body.split(None, 1)
        self.opcode = parts[0] if parts else ""
        self.operands = parts[1] if len(parts) > 1 else ""
        self.base, *self.mods = self.opcode.split(".")
        self._regs: set[int] | None = None

    def __repr__(self) -> str:
        return f"Instr(0x{self.addr:04x} {self.text})"

    @property
    def is_nop(self) -> bool:
        return self.base == "NOP"

    @property
    def is_branch(self) -> bool:
        return self.base == "BRA"

    @property
    def is_div_branch(self) -> bool:
        """BRA.DIV: taken only when the warp is diverged at a warp-synchronous instruction (to
        an out-of-line fallback); the analysis treats it as not taken."""
        return self.is_branch and "DIV" in self.mods

    @property
    def unconditional(self) -> bool:
        return (self.pred is None or self.pred == "@PT") and not self.is_div_branch

    @property
    def flow_target(self) -> int | None:
        """The branch target the control-flow analysis follows (None for BRA.DIV)."""
        return None if self.is_div_branch else self.branch_target

    @property
    def ends_flow(self) -> bool:
        return self.unconditional and (self.is_branch or self.base in ("EXIT", "RET", "BRX", "JMX"))

    @property
    def branch_target(self) -> int | None:
        if not self.is_branch:
            return None
        hits = re.findall(r"0x([0-9a-fA-F]+)", self.operands)
        return int(hits[-1], 16) if hits else None

    @property
    def is_global_load(self) -> bool:
        return self.base in GLOBAL_LOADS

    @property
    def is_global_store(self) -> bool:
        return self.base in GLOBAL_STORES

    @property
    def is_constant(self) -> bool:
        return CONSTANT_QUALIFIER in self.mods

    @property
    def width(self) -> int:
        """Access width in bits of a memory instruction (32 unless a size modifier says so)."""
        for mod in self.mods:
            if mod in ("64", "128", "256"):
                return int(mod)
            if mod in ("U8", "S8"):
                return 8
            if mod in ("U16", "S16"):
                return 16
        return 32

    @property
    def qualifiers(self) -> list[str]:
        return [m for m in self.mods if m not in ("64", "128", "256", "U8", "S8", "U16", "S16")]

    def _operand_list(self) -> list[str]:
        return [o.strip() for o in self.operands.split(",") if o.strip()]

    def registers(self) -> set[int]:
        """Every general register the instruction reads or writes, register pairs/quads expanded
        (memory data operands by the access width, `.64` address operands, IMAD.WIDE, CS2R)."""
        if self._regs is None:
            self._regs = self._registers()
        return self._regs

    def _registers(self) -> set[int]:
        regs: set[int] = set()
        ops = self._operand_list()
        memop = self.base in GLOBAL_LOADS + GLOBAL_STORES + LOCAL_OPS + ("LDS", "STS", "LDC", "ATOMG", "RED")
        for k, op in enumerate(ops):
            for m in _REG_RE.finditer(op):
                r = int(m.group(1))
                if m.group(2):
                    span = int(m.group(2)[1:]) // 32
                elif "[" in op:
                    span = 1
                elif memop:
                    span = max(1, self.width // 32)
                elif self.base == "CS2R" and k == 0:
                    span = 2
                elif self.opcode.startswith("IMAD.WIDE") and k in (0, len(ops) - 1):
                    span = 2
                else:
                    span = 1
                regs.update(range(r, r + span))
        return regs

    def dest_registers(self) -> set[int]:
        """Destination registers of a load (its first operand)."""
        ops = self._operand_list()
        if not ops:
            return set()
        span = max(1, self.width // 32)
        m = _REG_RE.search(ops[0])
        return set(range(int(m.group(1)), int(m.group(1)) + span)) if m else set()


def parse_sass(text: str) -> dict[tuple[int, str], list[Instr]]:
    """cuobjdump -sass output -> {(sm, mangled function name): [Instr, ...]} in address order."""
    funcs: dict[tuple[int, str], list[Instr]] = {}
    arch = 0
    cur: list[Instr] | None = None
    for line in text.splitlines():
        m = re.match(r"\s*code for sm_(\d+)", line)
        if m:
            arch = int(m.group(1))
            cur = None
            continue
        m = re.match(r"\s*Function\s*:\s*(\S+)", line)
        if m:
            cur = funcs.setdefault((arch, m.group(1)), [])
            continue
        if cur is None:
            continue
        m = _INSTR_RE.match(line)
        if m:
            cur.append(Instr(int(m.group(1), 16), m.group(2)))
    return funcs
