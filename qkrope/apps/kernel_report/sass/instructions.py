"""SASS instructions as ``cuobjdump -sass`` prints them: :class:`Instr` (address, guard predicate,
opcode and modifiers, operands, access width, registers read or written) and :func:`parse_sass`
(the listing -> instructions per function, in address order)."""
from __future__ import annotations

import re

__all__ = ["CONSTANT_QUALIFIER", "STORE_POLICY_QUALIFIERS", "GLOBAL_LOADS", "GLOBAL_STORES",
           "LOCAL_OPS", "Control", "decode_control", "Instr", "parse_sass"]

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
_WORD_RE = re.compile(r"/\*\s*0x([0-9a-fA-F]{16})\s*\*/\s*$")


class Control:
    """The scheduling control bits of one instruction (sm_70 and later: bits 105-125 of the
    128-bit instruction, i.e. bits 41-61 of its high 64-bit word, which ``cuobjdump -sass`` prints
    on the line after the instruction): stall cycles (4 bits), yield (1), the scoreboard that the
    instruction's variable-latency result sets (write barrier, 3 bits, 7 = none), the scoreboard
    its operand read sets (read barrier: released once the source registers have been read), the
    wait mask (6 bits: the scoreboards that must be clear before it issues) and the operand reuse
    flags (4)."""

    __slots__ = ("stall", "yield_", "write_sb", "read_sb", "wait_mask", "reuse")

    def __init__(self, stall: int, yield_: int, write_sb: int | None, read_sb: int | None,
                 wait_mask: int, reuse: int):
        self.stall, self.yield_ = stall, yield_
        self.write_sb, self.read_sb = write_sb, read_sb
        self.wait_mask, self.reuse = wait_mask, reuse

    def __repr__(self) -> str:
        return (f"Control(stall={self.stall}, wr={self.write_sb}, rd={self.read_sb}, "
                f"wait={self.wait_mask:06b})")

    def waits_on(self) -> list[int]:
        return [k for k in range(6) if self.wait_mask >> k & 1]


def decode_control(high_word: int) -> Control:
    """The control bits of an instruction from its high 64-bit word (see :class:`Control`)."""
    c = high_word >> 41
    wr, rd = (c >> 5) & 7, (c >> 8) & 7
    return Control(stall=c & 15, yield_=(c >> 4) & 1, write_sb=None if wr == 7 else wr,
                   read_sb=None if rd == 7 else rd, wait_mask=(c >> 11) & 63, reuse=(c >> 17) & 15)
_REG_RE = re.compile(r"(?<![\w.])R(\d+)(\.64|\.128)?")
_PRED_RE = re.compile(r"^(@!?U?P(?:T|\d+))\s+(.*)$")


class Instr:
    """One SASS instruction: address, guard predicate, opcode with modifiers, operands."""

    __slots__ = ("addr", "pred", "opcode", "operands", "text", "base", "mods", "_regs", "control")

    def __init__(self, addr: int, text: str, control: Control | None = None):
        self.addr = addr
        self.text = text
        self.control = control  # None where the listing carries no encoding (synthetic listings)
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
    lines = text.splitlines()
    for n, line in enumerate(lines):
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
            # the encoding: the low word at the end of this line, the high word (with the control
            # bits) alone on the next one; both 16 hex digits, else no control bits are read
            ctrl = None
            if _WORD_RE.search(line) and n + 1 < len(lines):
                hi = _WORD_RE.search(lines[n + 1])
                if hi and not _INSTR_RE.match(lines[n + 1]):
                    ctrl = decode_control(int(hi.group(1), 16))
            cur.append(Instr(int(m.group(1), 16), m.group(2), ctrl))
    return funcs
