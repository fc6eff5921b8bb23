#!/usr/bin/env python3
"""Static performance report of the qkrope CUDA kernel.

Compiles plugins/kernel/qknorm_rope.cu for sm_90 (and sm_100) into build/kernel_report/ and
prints, per kernel instance:
  - from ptxas (-Xptxas -v): registers, spill stores/loads, stack frame, static shared memory, and
    the occupancy those imply (computed here from the HARDWARE table below);
  - from the SASS (cuobjdump -sass, which needs nvdisasm): the hot loop (the innermost loop that
    contains the 128-bit q/k stores), the width and qualifiers of every global load/store in it,
    the instruction counts along the common path (prologue, one loop iteration, epilogue; slow-path
    call blocks and the NaN fix-up excluded), the instruction mix, and the 128-bit q/k loads still
    outstanding at each token's first wait;
and then runs the real launcher (the same source under the SIMT emulation, dry run) against the
modelled devices MODELLED_DEVICES (H100, H200, B200, L40S, A100: SM counts, clocks, bus widths,
occupancy from each instance's ptxas registers) for every Qwen-Image problem, and reports for each
instance a launch picks: whole-kernel instructions per element (one iteration per token plus the
prologue and epilogue amortised over that launch's tokens per row group) and the q/k bytes
outstanding per SM at a token's first wait.

    python scripts/kernel_report.py                      # sm_90 and sm_100, text table
    python scripts/kernel_report.py --arch 90 --json build/kernel_report/report.json
    python scripts/kernel_report.py --cubin some.cubin   # analyse an existing cubin
    python scripts/kernel_report.py --check              # exit 1 when a structural fact fails

--check asserts static facts only (tests/test_kernel_report.py and scripts/gpu_check.sh use it):
128-bit q/k loads and stores in the fast-path hot loop, no spills / local memory on the fast path,
stores with the default cache policy, the Qwen instances' per-token instructions under THRESHOLDS,
and, for the launched instances on the sm_90 devices, LAUNCH_TARGETS (bytes in flight per SM and
whole-kernel instructions per element). Speed itself is measured by scripts/bench_kernel.py.

Exit status: 0 ok, 1 a --check fact failed, 2 a tool is missing or the build/analysis failed.
"""
from __future__ import annotations

import argparse
import collections
import glob
import json
import math
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "plugins" / "kernel" / "qknorm_rope.cu"
BUILD_DIR = ROOT / "build" / "kernel_report"
DEFAULT_ARCHS = (90, 100)

# =============================================================================================
# Everything the report assumes, in one place.
# =============================================================================================

# Hardware figures per SM architecture. Figures marked "assumed" are not read from any device:
# they are public nominal numbers (or plain estimates) and only scale the printed bounds; no
# --check depends on them.
HARDWARE = {
    90: {
        "gpu": "H200 SXM",
        "sms": 132,
        "schedulers_per_sm": 4,          # 1 warp-instruction issued per scheduler per cycle
        "clock_ghz": 1.98,               # assumed: boost clock; under load it may be lower
        "dram_tb_s": 4.8,                # nominal HBM3e bandwidth
        "dram_latency_ns": 1000,         # assumed: loaded DRAM latency, the launch plan's figure
                                         # (qknorm_rope_plan.h dramLatencyNs; ~0.8-1 us on Hopper)
        "regs_per_sm": 65536,
        "reg_alloc_unit_per_warp": 256,  # registers are allocated per warp in units of 256
        "max_regs_per_thread": 255,
        "max_warps_per_sm": 64,          # 2048 threads
        "max_blocks_per_sm": 32,
        "smem_per_sm": 228 * 1024,
        "smem_reserved_per_block": 1024,  # the driver's per-block system reservation
        "smem_max_per_block": 227 * 1024,
    },
    100: {
        "gpu": "B200 (assumed figures)",
        "sms": 148,                      # assumed
        "schedulers_per_sm": 4,
        "clock_ghz": 1.9,                # assumed
        "dram_tb_s": 8.0,                # assumed: nominal HBM3e bandwidth
        "dram_latency_ns": 1000,         # assumed: the launch plan's figure (dramLatencyNs)
        "regs_per_sm": 65536,
        "reg_alloc_unit_per_warp": 256,
        "max_regs_per_thread": 255,
        "max_warps_per_sm": 64,
        "max_blocks_per_sm": 32,
        "smem_per_sm": 228 * 1024,
        "smem_reserved_per_block": 1024,
        "smem_max_per_block": 227 * 1024,
    },
}

# The problem the bounds are stated for: one Qwen-Image transformer block at 1024x1024, both
# streams (4096 image + 512 text tokens), 24 heads of 128, bf16, one fp32 cache row per token.
PROBLEM = {
    "name": "Qwen-Image block, 1024x1024: 4096 image + 512 text tokens, 24 heads x 128, bf16",
    "tokens": 4096 + 512,
    "heads": 24,
    "head_dim": 128,
    "rotary_dim": 128,
    "elem_bytes": 2,
    "cache_value_bytes": 4,
}

# Per-token threshold on the Qwen instances (one loop iteration along the common path per
# element; DESIGN.md: "<= 20 SASS instructions per element (26 with rounding=1)"). Key: rounding.
THRESHOLDS = {0: 20, 1: 26}
THRESHOLD_SOURCE = 'DESIGN.md: "<= 20 SASS instructions per element (26 with rounding=1)"'

# Modelled GPUs the real launcher is run against (through the SIMT emulation's modelled device,
# in dry-run mode): what cudaDeviceGetAttribute answers there. Memory clock x bus width gives the
# nominal DRAM bandwidth (2 x clock x width / 8): H100 SXM 3.35 TB/s, H200 4.8, B200 8.0, L40S
# 0.864, A100 80GB 2.04. Public nominal figures, not read from a device.
MODELLED_DEVICES = {
    "H100 SXM": {"arch": 90, "sms": 132, "cc": (9, 0), "max_threads_per_sm": 2048, "max_blocks_per_sm": 32,
                 "clock_khz": 1980000, "mem_clock_khz": 2619000, "bus_width_bits": 5120},
    "H200 SXM": {"arch": 90, "sms": 132, "cc": (9, 0), "max_threads_per_sm": 2048, "max_blocks_per_sm": 32,
                 "clock_khz": 1980000, "mem_clock_khz": 3125000, "bus_width_bits": 6144},
    "B200": {"arch": 100, "sms": 148, "cc": (10, 0), "max_threads_per_sm": 2048, "max_blocks_per_sm": 32,
             "clock_khz": 1965000, "mem_clock_khz": 3906000, "bus_width_bits": 8192},
    "L40S": {"arch": 89, "sms": 142, "cc": (8, 9), "max_threads_per_sm": 1536, "max_blocks_per_sm": 24,
             "clock_khz": 2520000, "mem_clock_khz": 9000000, "bus_width_bits": 384},
    "A100 SXM 80GB": {"arch": 80, "sms": 108, "cc": (8, 0), "max_threads_per_sm": 2048,
                      "max_blocks_per_sm": 32, "clock_khz": 1410000, "mem_clock_khz": 1593000,
                      "bus_width_bits": 5120},
}
# The Qwen-Image launches: one per stream of a block (24 heads x 128, bf16, interleaved, full
# rotary), image tokens (resolution / 16)^2, text 512 tokens, batch 1 and 2.
QWEN_RESOLUTIONS = (512, 1024, 1328)
QWEN_TEXT_TOKENS = 512
QWEN_BATCHES = (1, 2)
QWEN_HEADS, QWEN_HEAD_DIM = 24, 128
# Static targets of a launched Qwen instance on an sm_90 device (H100/H200), by the launch's
# tokens (batch x sequence): q/k read bytes outstanding per SM at a token's first wait, and
# whole-kernel common-path SASS instructions per element by rounding mode (DESIGN.md, performance
# targets: twice Little's law for 85 % of the H200's bandwidth at ~1 us of loaded latency).
LAUNCH_TARGETS = (
    {"min_tokens": 4096, "bytes_in_flight_per_sm": 24 * 1024, "instr_per_element": {0: 20, 1: 26}},
    {"min_tokens": 0, "bytes_in_flight_per_sm": 16 * 1024, "instr_per_element": {0: 26, 1: 26}},
)
TARGET_ARCHS = (90,)


def launch_target(tokens: int) -> dict:
    return next(t for t in LAUNCH_TARGETS if tokens >= t["min_tokens"])


def qwen_problems() -> list[dict]:
    out = []
    for batch in QWEN_BATCHES:
        for res in QWEN_RESOLUTIONS:
            out.append({"stream": f"image {res}x{res}", "batch": batch, "seq": (res // 16) ** 2})
        out.append({"stream": f"text {QWEN_TEXT_TOKENS}", "batch": batch, "seq": QWEN_TEXT_TOKENS})
    for p in out:
        p["tokens"] = p["batch"] * p["seq"]
    return out


# Kernel names (the demangled function template names) and their template parameter names.
# The names are read from a machine-readable line in the .cu when there is one, e.g.
#   // kernel-report: qkNormRopeFastKernel<T, HEAD_DIM, INTERLEAVED, ROWS, ROUNDING, FULL_ROTARY>
# and otherwise from FALLBACK_PARAMS (the kernel before the rewrite, where rounding is a runtime
# argument). PARAM_ROLES says which parameter name means what.
FAST_KERNEL = "qkNormRopeFastKernel"
GENERAL_KERNEL = "qkNormRopeGeneralKernel"
KERNEL_NAMESPACE = "qkrope::(anonymous namespace)::"
FALLBACK_PARAMS = {
    FAST_KERNEL: ("T", "HEAD_DIM", "INTERLEAVED", "UNROLL"),
    GENERAL_KERNEL: ("T",),
}
KERNEL_REPORT_RE = re.compile(r"//\s*kernel-report:\s*(\w+)\s*<([^>]*)>")
PARAM_ROLES = {
    "type": ("T",),
    "head_dim": ("HEAD_DIM",),
    "interleaved": ("INTERLEAVED",),
    "rounding": ("ROUNDING", "ROUNDING_MODE"),
    "full_rotary": ("FULL_ROTARY",),
    "rows": ("ROWS",),
}
# The Qwen-Image instance(s): every fast-path instance whose parameters with these roles have
# these values (a tuple: any of them; a role the kernel has no parameter for is not compared).
# Every rows-per-unit instance of that family is one the launcher may pick (plan_launches says which
# it does pick for each Qwen problem and modelled device).
QWEN_MATCH = {"type": "Bf16", "head_dim": "128", "interleaved": "true", "full_rotary": "true"}
ELEMENT_BYTES = {"Fp32": 4, "Fp16": 2, "Bf16": 2}

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
FIXES = {
    "nvcc": "install the CUDA toolkit (nvcc) or pass --nvcc PATH",
    "cuobjdump": "pip install nvidia-cuda-cuobjdump (a test extra: bash scripts/setup_env.sh), "
                 "or pass --cuobjdump PATH",
    "nvdisasm": "pip install nvidia-cuda-nvdisasm (a test extra: bash scripts/setup_env.sh); "
                "cuobjdump -sass runs it",
    "c++filt": "install binutils (c++filt)",
}


class ToolError(RuntimeError):
    """A tool is missing or failed; the message names it and the fix."""


# =============================================================================================
# Tools
# =============================================================================================

def _runs(cmd: str) -> bool:
    try:
        res = subprocess.run([cmd, "--version"], capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return False
    return res.returncode == 0


def _site_packages() -> list[Path]:
    dirs: list[str] = []
    for key in ("purelib", "platlib"):
        try:
            dirs.append(sysconfig.get_paths()[key])
        except KeyError:
            pass
    dirs += [p for p in sys.path if p.endswith("site-packages")]
    dirs += sorted(glob.glob(str(ROOT / ".venv" / "lib" / "python*" / "site-packages")))
    out: list[Path] = []
    for d in dirs:
        p = Path(d)
        if p.is_dir() and p not in out:
            out.append(p)
    return out


def wheel_bin_dirs() -> list[Path]:
    """Where the PyPI wheels put their binaries: nvidia-cuda-cuobjdump/-nvdisasm 13.x install
    into site-packages/nvidia/cu13/bin (12.x used nvidia/cuda_cuobjdump/bin)."""
    subs = ("nvidia/cu13/bin", "nvidia/cuda_cuobjdump/bin", "nvidia/cuda_nvdisasm/bin")
    return [sp / s for sp in _site_packages() for s in subs if (sp / s).is_dir()]


def find_nvcc(explicit: str | None = None) -> str | None:
    if explicit:
        return explicit if _runs(explicit) else None
    try:
        sys.path.insert(0, str(ROOT))
        from qkrope.runtime.plugin_build import find_nvcc as _find  # the project's one rule
        return _find()
    except Exception:  # noqa: BLE001 - package not importable: same rule, locally
        for cand in (os.environ.get("CUDACXX"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
            if cand and _runs(cand):
                return cand
        return None
    finally:
        if sys.path and sys.path[0] == str(ROOT):
            sys.path.pop(0)


def find_tool(name: str, explicit: str | None = None, nvcc: str | None = None) -> str | None:
    """A CUDA binary tool (cuobjdump, nvdisasm): explicit path, PATH, $CUDA_HOME/bin,
    /usr/local/cuda/bin, next to nvcc, then the PyPI wheels' bin folders. None if absent."""
    if explicit:
        return explicit if _runs(explicit) else None
    cands: list[str | None] = [shutil.which(name)]
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            cands.append(os.path.join(os.environ[env], "bin", name))
    cands.append(f"/usr/local/cuda/bin/{name}")
    if nvcc:
        cands.append(os.path.join(os.path.dirname(os.path.realpath(nvcc)), name))
    cands += [str(d / name) for d in wheel_bin_dirs()]
    for c in cands:
        if c and os.path.isfile(c) and os.access(c, os.X_OK) and _runs(c):
            return c
    return None


def find_cxxfilt() -> str | None:
    for c in (shutil.which("c++filt"), shutil.which("cu++filt"), "/usr/local/cuda/bin/cu++filt"):
        if c and os.path.isfile(c):
            return c
    return None


class Tools:
    """The resolved tools; each missing one raises ToolError naming the fix when first needed."""

    def __init__(self, nvcc: str | None = None, cuobjdump: str | None = None,
                 nvdisasm: str | None = None, need_nvcc: bool = True):
        self.nvcc = find_nvcc(nvcc) if need_nvcc else (find_nvcc(nvcc) if nvcc else None)
        if need_nvcc and not self.nvcc:
            raise ToolError(f"nvcc not found{f' at {nvcc}' if nvcc else ''}: {FIXES['nvcc']}")
        self.cuobjdump = find_tool("cuobjdump", cuobjdump, self.nvcc)
        if not self.cuobjdump:
            raise ToolError(f"cuobjdump not found{f' at {cuobjdump}' if cuobjdump else ''}: "
                            f"{FIXES['cuobjdump']}")
        self.nvdisasm = find_tool("nvdisasm", nvdisasm, self.nvcc)
        if not self.nvdisasm:
            # look next to cuobjdump too (both wheels share nvidia/cu13/bin)
            side = os.path.join(os.path.dirname(self.cuobjdump), "nvdisasm")
            self.nvdisasm = side if os.path.isfile(side) and _runs(side) else None
        if not self.nvdisasm:
            raise ToolError(f"nvdisasm not found: {FIXES['nvdisasm']}")
        self.cxxfilt = find_cxxfilt()
        if not self.cxxfilt:
            raise ToolError(f"c++filt not found: {FIXES['c++filt']}")

    def cuobjdump_run(self, *args: str) -> str:
        env = dict(os.environ)
        env["NVDISASM_PATH"] = os.path.dirname(self.nvdisasm)
        env["PATH"] = os.path.dirname(self.nvdisasm) + os.pathsep + env.get("PATH", "")
        res = subprocess.run([self.cuobjdump, *args], capture_output=True, text=True, env=env)
        if res.returncode != 0:
            raise ToolError(f"cuobjdump {' '.join(args)} failed (rc={res.returncode}): "
                            f"{res.stderr.strip()[-500:]}")
        return res.stdout

    def demangle(self, names: list[str]) -> dict[str, str]:
        if not names:
            return {}
        res = subprocess.run([self.cxxfilt], input="\n".join(names) + "\n", capture_output=True,
                             text=True)
        out = res.stdout.splitlines()
        if res.returncode != 0 or len(out) != len(names):
            raise ToolError(f"{self.cxxfilt} failed (rc={res.returncode}): {res.stderr.strip()[-300:]}")
        return dict(zip(names, out))


# =============================================================================================
# Build and the text the tools print
# =============================================================================================

def compile_cubins(archs: list[int], nvcc: str, source: Path = SOURCE,
                   out_dir: Path = BUILD_DIR) -> dict[int, tuple[Path, str]]:
    """nvcc -cubin -Xptxas -v for each arch (in parallel); {arch: (cubin, ptxas log)}."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    procs = {}
    for arch in archs:
        cubin = out_dir / f"qknorm_rope_sm{arch}.cubin"
        log = out_dir / f"qknorm_rope_sm{arch}.ptxas.log"
        cmd = [nvcc, "-std=c++17", "-O3", "-cubin", f"-arch=sm_{arch}", "-Xptxas", "-v",
               "-I", str(Path(source).parent), str(source), "-o", str(cubin)]
        fh = open(log, "w")  # noqa: SIM115 - closed below
        procs[arch] = (subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, text=True), fh,
                       cubin, log, cmd)
    result = {}
    errors = []
    for arch, (proc, fh, cubin, log, cmd) in procs.items():
        proc.wait()
        fh.close()
        text = log.read_text()
        if proc.returncode != 0:
            errors.append(f"sm_{arch}: {' '.join(cmd)} failed (rc={proc.returncode}); last lines "
                          f"of {log}:\n" + "\n".join(text.splitlines()[-15:]))
        result[arch] = (cubin, text)
    if errors:
        raise ToolError("kernel build failed:\n" + "\n".join(errors))
    return result


def parse_ptxas(log: str) -> dict[str, dict]:
    """ptxas -v lines -> {mangled name: {regs, spill_stores, spill_loads, stack, smem, barriers}}."""
    funcs: dict[str, dict] = {}
    cur = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            cur = m.group(1)
            funcs.setdefault(cur, {})["entry"] = True
            continue
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            cur = m.group(1)
            funcs.setdefault(cur, {})
            continue
        if cur is None:
            continue
        m = re.search(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            funcs[cur].update(stack=int(m.group(1)), spill_stores=int(m.group(2)),
                              spill_loads=int(m.group(3)))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            funcs[cur]["regs"] = int(m.group(1))
            sm = re.search(r"(\d+) bytes smem", line)
            funcs[cur]["smem"] = int(sm.group(1)) if sm else 0
            bm = re.search(r"used (\d+) barriers", line)
            funcs[cur]["barriers"] = int(bm.group(1)) if bm else 0
    return funcs


def parse_res_usage(text: str) -> dict[str, dict]:
    """cuobjdump -res-usage -> {mangled: {regs, stack, shared, local}} (shared includes the
    1 KiB system reservation when the kernel uses shared memory at all)."""
    out: dict[str, dict] = {}
    cur = None
    for line in text.splitlines():
        m = re.match(r"\s*Function (\S+):\s*$", line)
        if m:
            cur = m.group(1)
            continue
        m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", line)
        if m and cur:
            out[cur] = {"regs": int(m.group(1)), "stack": int(m.group(2)),
                        "shared": int(m.group(3)), "local": int(m.group(4))}
            cur = None
    return out


def parse_max_threads(elf_text: str) -> dict[str, int]:
    """cuobjdump -elf: EIATTR_MAX_THREADS (from __launch_bounds__) per function."""
    out: dict[str, int] = {}
    cur = None
    want_value = False
    for line in elf_text.splitlines():
        m = re.match(r"^\.nv\.info\.(\S+)\s*$", line)
        if m:
            cur, want_value = m.group(1), False
            continue
        if cur and "EIATTR_MAX_THREADS" in line:
            want_value = True
            continue
        if cur and want_value:
            m = re.search(r"Value:\s*(0x[0-9a-fA-F]+)\s+(0x[0-9a-fA-F]+)\s+(0x[0-9a-fA-F]+)", line)
            if m:
                out[cur] = int(m.group(1), 16) * int(m.group(2), 16) * int(m.group(3), 16)
                want_value = False
    return out


# =============================================================================================
# SASS
# =============================================================================================

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
    return [{"addr": f"0x{i.addr:04x}", "sass": i.text, "kind": "load" if i.is_global_load else "store",
             "width": i.width, "qualifiers": i.qualifiers, "constant": i.is_constant,
             "predicated": i.pred is not None}
            for i in instrs if i.is_global_load or i.is_global_store]


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
    }


# =============================================================================================
# Names, parameters, occupancy, bounds
# =============================================================================================

def read_param_names(source_text: str | None) -> tuple[dict[str, tuple[str, ...]], dict[str, str]]:
    """Template parameter names per kernel: the `// kernel-report:` lines of the source where
    present, else FALLBACK_PARAMS. Returns (names, origin per kernel)."""
    names = dict(FALLBACK_PARAMS)
    origin = {k: "fallback (no kernel-report line)" for k in FALLBACK_PARAMS}
    for m in KERNEL_REPORT_RE.finditer(source_text or ""):
        names[m.group(1)] = tuple(p.strip() for p in m.group(2).split(",") if p.strip())
        origin[m.group(1)] = "kernel-report line in the source"
    return names, origin


def template_args(demangled: str, kernel: str) -> list[str] | None:
    """The template argument list after `kernel<` (balanced), split at top-level commas, each
    normalised: namespaces dropped (`qkrope::math::Bf16` -> `Bf16`), casts dropped
    (`(qkrope::math::Rounding)1` -> `1`)."""
    start = demangled.find(kernel + "<")
    if start < 0:
        return None
    i = start + len(kernel) + 1
    depth, cur, args = 1, "", []
    while i < len(demangled) and depth:
        c = demangled[i]
        if c in "<([":
            depth += 1
        elif c in ">)]":
            depth -= 1
        if depth == 0:
            break
        if c == "," and depth == 1:
            args.append(cur)
            cur = ""
        else:
            cur += c
        i += 1
    args.append(cur)
    out = []
    for a in args:
        a = a.strip()
        a = re.sub(r"^\([^()]*\)\s*", "", a)          # (Enum)1 -> 1
        a = a.split("::")[-1] if re.fullmatch(r"[\w:]+", a) else a
        out.append(a)
    return out


def role_values(params: dict[str, str]) -> dict[str, str]:
    out = {}
    for role, names in PARAM_ROLES.items():
        for n in names:
            if n in params:
                out[role] = params[n]
    return out


def is_qwen(kind: str, roles: dict[str, str]) -> bool:
    """A fast-path instance whose parameters match QWEN_MATCH (type, head_dim and interleaved
    must be template parameters; full_rotary is compared only where the kernel has it)."""
    if kind != "fast" or not all(r in roles for r in ("type", "head_dim", "interleaved")):
        return False
    def ok(have: str, want) -> bool:
        wanted = (want,) if isinstance(want, str) else want
        return have.lower() in (w.lower() for w in wanted)
    return all(ok(roles[r], v) for r, v in QWEN_MATCH.items() if r in roles)


def rounding_value(v: str) -> int | None:
    v = v.strip().lower()
    if v in ("true", "false"):
        return int(v == "true")
    try:
        return int(v.rstrip("u"), 0)
    except ValueError:
        return None


def occupancy(regs: int, smem_static: int, threads: int, hw: dict) -> dict:
    """Resident blocks per SM from registers (per-warp allocation rounded up to the unit), shared
    memory (static + the per-block reservation; dynamic shared memory is 0 for these kernels),
    threads, and the block limit."""
    warps = max(1, math.ceil(threads / 32))
    unit = hw["reg_alloc_unit_per_warp"]
    per_warp = math.ceil(max(regs, 1) * 32 / unit) * unit
    limits = {
        "registers": hw["regs_per_sm"] // (per_warp * warps),
        "shared memory": hw["smem_per_sm"] // (smem_static + hw["smem_reserved_per_block"]),
        "threads": hw["max_warps_per_sm"] // warps,
        "blocks": hw["max_blocks_per_sm"],
    }
    if smem_static > hw["smem_max_per_block"]:
        limits["shared memory"] = 0
    blocks = min(limits.values())
    limiter = min(limits, key=lambda k: (limits[k], k != "registers"))
    return {"blocks_per_sm": blocks, "threads_per_sm": blocks * threads,
            "occupancy": blocks * warps / hw["max_warps_per_sm"], "limiter": limiter,
            "limits": limits}


def qwen_bounds(instr_per_element: float | None, qk_loads_in_flight: int, threads_per_sm: int,
                hw: dict, problem: dict = PROBLEM) -> dict:
    """Issue-rate floor vs memory floor for PROBLEM, and bytes in flight per SM vs the GPU's
    bandwidth-latency product per SM."""
    p = problem
    tensor_bytes = p["tokens"] * p["heads"] * p["head_dim"] * p["elem_bytes"] * 4  # q, k in; q, k out
    cache_bytes = p["tokens"] * p["rotary_dim"] * p["cache_value_bytes"]
    total = tensor_bytes + cache_bytes
    bw = hw["dram_tb_s"] * 1e12
    mem_us = total / bw * 1e6
    elements = p["tokens"] * 2 * p["heads"] * p["head_dim"]
    out = {"bytes": total, "memory_floor_us": mem_us, "elements": elements}
    issue_rate = hw["sms"] * hw["schedulers_per_sm"] * hw["clock_ghz"] * 1e9  # warp-instr / s
    if instr_per_element:
        warp_instr = elements / 32 * instr_per_element
        issue_us = warp_instr / issue_rate * 1e6
        out.update(warp_instructions=warp_instr, issue_floor_us=issue_us,
                   bound="issue rate" if issue_us > mem_us else "memory",
                   floor_us=max(issue_us, mem_us),
                   fraction_of_peak_bw=mem_us / max(issue_us, mem_us),
                   break_even_instr_per_element=mem_us * 1e-6 * issue_rate * 32 / elements)
    need = bw * hw["dram_latency_ns"] * 1e-9 / hw["sms"]
    have = qk_loads_in_flight * 16 * threads_per_sm
    out.update(bytes_in_flight_needed_per_sm=need, bytes_in_flight_per_sm=have,
               in_flight_ratio=have / need if need else None,
               latency_bound_read_tb_s=have * hw["sms"] / (hw["dram_latency_ns"] * 1e-9) / 1e12)
    return out


def assumptions(arch: int) -> list[str]:
    hw = HARDWARE.get(arch, HARDWARE[90])
    p = PROBLEM
    return [
        f"hardware sm_{arch}: {hw['gpu']}, {hw['sms']} SMs, {hw['schedulers_per_sm']} schedulers/SM "
        f"issuing 1 warp-instruction/cycle each at {hw['clock_ghz']} GHz, {hw['dram_tb_s']} TB/s DRAM, "
        f"{hw['dram_latency_ns']} ns loaded DRAM latency (clock, latency"
        f"{', and for sm_100 all figures' if arch >= 100 else ''} are assumptions)",
        f"problem: {p['name']}; bytes = tokens x heads x head_dim x {p['elem_bytes']} B x 4 tensors "
        f"(q, k read; q_out, k_out written) + tokens x rotary_dim x {p['cache_value_bytes']} B cache; "
        "weights negligible",
        "issue floor = elements / 32 x instructions per element / (SMs x schedulers x clock): assumes "
        "perfect issue (no stalls, no dual-issue) and that the hot loop is all the work",
        "instructions per element = non-NOP SASS instructions from the hot-loop head to its back edge "
        "inclusive / elements stored per iteration (global store bytes in the loop / element size; "
        "each output element is stored exactly once); cold paths (IEEE div/sqrt slow paths) are "
        "assumed to sit outside the loop's address range (CALL.REL to subroutines after EXIT), so "
        "the count is the common path plus branch-arounds; 'skipped' counts the in-range "
        "instructions some forward branch jumps over (an upper bound on that error), 'longest "
        "path' the most instructions on one head-to-back-edge path",
        "loads in flight: a load is outstanding from issue until the first instruction that reads "
        "or overwrites its destination registers, walking the loop body twice in address order "
        "(ignores branches and scoreboard details); bytes in flight per SM = max outstanding "
        "128-bit q/k loads x 16 B x resident threads per SM",
        "bytes in flight needed per SM = bandwidth x latency / SMs (Little's law, counting all "
        "traffic as reads: conservative, stores are posted)",
        "occupancy: registers allocated per warp in units of "
        f"{hw['reg_alloc_unit_per_warp']}, {hw['regs_per_sm']} registers, {hw['max_warps_per_sm']} "
        f"warps, {hw['max_blocks_per_sm']} blocks, {hw['smem_per_sm'] // 1024} KiB shared memory "
        f"per SM with {hw['smem_reserved_per_block']} B reserved per block, no dynamic shared memory",
    ]


# =============================================================================================
# The report
# =============================================================================================

def analyse_function(instrs: list[Instr], demangled: str, arch: int, *, mangled: str = "",
                     ptxas: dict | None = None, res_usage: dict | None = None,
                     max_threads: int | None = None,
                     param_names: dict[str, tuple[str, ...]] | None = None) -> dict:
    """One kernel instance: its SASS, demangled name and resource figures -> the report entry
    (a JSON-ready dict). `param_names_mismatch` is set when the template parameter names did
    not fit the instance's argument count."""
    names = param_names if param_names is not None else dict(FALLBACK_PARAMS)
    dn = demangled
    kind = "fast" if FAST_KERNEL + "<" in dn else "general" if GENERAL_KERNEL + "<" in dn else "other"
    kernel = FAST_KERNEL if kind == "fast" else GENERAL_KERNEL if kind == "general" else None
    args = template_args(dn, kernel) if kernel else None
    pnames = names.get(kernel, ()) if kernel else ()
    mismatch = False
    if args is not None and len(args) != len(pnames):
        # e.g. --cubin of an older build against a newer source: the names do not apply
        fb = FALLBACK_PARAMS.get(kernel, ())
        pnames = fb if len(fb) == len(args) else ()
        mismatch = True
    params = {}
    if args is not None:
        for k, a in enumerate(args):
            params[pnames[k] if k < len(pnames) else f"ARG{k}"] = a
    roles = role_values(params)
    elem_type = roles.get("type", args[0] if args else "")
    elem_bytes = ELEMENT_BYTES.get(elem_type, 0)
    hw = HARDWARE.get(arch, HARDWARE[90])

    px = ptxas or {}
    ru = res_usage or {}
    regs = px.get("regs", ru.get("regs", 0))
    if "smem" in px:
        smem = px["smem"]
    else:
        shared = ru.get("shared", 0)
        smem = shared - hw["smem_reserved_per_block"] if shared >= hw["smem_reserved_per_block"] else shared
    threads = max_threads
    threads_src = "__launch_bounds__ (EIATTR_MAX_THREADS)"
    if not threads:
        threads, threads_src = 256, "assumed 256 (no __launch_bounds__ in the ELF)"
    occ = occupancy(regs, smem, threads, hw)
    local_ops = [i.text for i in instrs if i.base in LOCAL_OPS]
    store_policies = sorted({q for i in instrs if i.is_global_store for q in i.qualifiers
                             if q in STORE_POLICY_QUALIFIERS})
    loop = analyse_loop(instrs, elem_bytes)

    short = {"fast": "Fast", "general": "General"}.get(kind, dn.split("(")[0])
    label = f"{short}<{','.join(args)}>" if args is not None else short
    qwen = is_qwen(kind, roles)
    rounding = threshold = threshold_note = None
    if qwen:
        if "rounding" in roles:
            rounding = rounding_value(roles["rounding"])
            threshold = THRESHOLDS.get(rounding)
            threshold_note = f"rounding={rounding} is a template argument"
        else:
            threshold = min(THRESHOLDS.values())
            threshold_note = ("rounding is a runtime argument: the hot loop holds the rounding=0 "
                              "and rounding=1 paths combined, checked against the stricter "
                              f"rounding=0 threshold ({threshold})")
    inst = {
        "arch": arch, "mangled": mangled, "demangled": dn, "kind": kind, "label": label,
        "template_params": params, "param_names_mismatch": mismatch, "roles": roles, "qwen": qwen,
        "rounding": rounding, "threshold": threshold, "threshold_note": threshold_note,
        "elem_bytes": elem_bytes,
        "regs": regs, "spill_stores": px.get("spill_stores"), "spill_loads": px.get("spill_loads"),
        "stack": px.get("stack", ru.get("stack")), "local": ru.get("local"), "smem": smem,
        "threads_per_block": threads, "threads_source": threads_src,
        "occupancy": occ, "local_memory_sass": local_ops, "store_policies": store_policies,
        "sass_instructions": sum(1 for i in instrs if not i.is_nop),
        "hot_loop": loop,
    }
    if qwen and loop.get("found"):
        inst["bounds"] = qwen_bounds(loop.get("instr_per_element"), loads_at_first_wait(loop),
                                     occ["threads_per_sm"], hw)
    return inst


def analyse_cubin(cubin: Path, tools: Tools, *, ptxas_log: str | None = None,
                  source_text: str | None = None, archs: list[int] | None = None) -> dict:
    """All instances of one cubin (or fat binary) -> {sm: {"instances": [...], ...}}."""
    functions = parse_sass(tools.cuobjdump_run("-sass", str(cubin)))
    if not functions:
        raise ToolError(f"no SASS functions in {cubin} (cuobjdump -sass printed nothing usable)")
    res_usage = parse_res_usage(tools.cuobjdump_run("-res-usage", str(cubin)))
    try:
        max_threads = parse_max_threads(tools.cuobjdump_run("-elf", str(cubin)))
    except ToolError:
        max_threads = {}
    ptxas = parse_ptxas(ptxas_log) if ptxas_log else {}
    demangled = tools.demangle(sorted({name for _, name in functions}))
    names, origin = read_param_names(source_text)

    result: dict = {}
    for (arch, mangled), instrs in sorted(functions.items()):
        if archs and arch not in archs:
            continue
        inst = analyse_function(instrs, demangled.get(mangled, mangled), arch, mangled=mangled,
                                ptxas=ptxas.get(mangled), res_usage=res_usage.get(mangled),
                                max_threads=max_threads.get(mangled), param_names=names)
        entry = result.setdefault(arch, {
            "instances": [], "param_names": {k: list(v) for k, v in names.items()},
            "param_origin": dict(origin), "ptxas": bool(ptxas), "assumptions": assumptions(arch),
            "hardware": HARDWARE.get(arch, HARDWARE[90])})
        entry["instances"].append(inst)
        if inst["param_names_mismatch"]:
            kernel = FAST_KERNEL if inst["kind"] == "fast" else GENERAL_KERNEL
            note = " - does not fit this binary's template arguments: fallback names or ARGn used"
            if not entry["param_origin"].get(kernel, "").endswith(note):
                entry["param_origin"][kernel] = entry["param_origin"].get(kernel, "") + note
    kind_order = {"fast": 0, "general": 1, "other": 2}
    for entry in result.values():
        entry["instances"].sort(key=lambda x: (kind_order[x["kind"]], not x["qwen"], _natural(x["label"])))
    return result


def _label_of(demangled: str) -> str | None:
    kind = FAST_KERNEL if FAST_KERNEL + "<" in demangled else GENERAL_KERNEL if GENERAL_KERNEL + "<" in demangled else None
    if kind is None:
        return None
    args = template_args(demangled, kind)
    short = "Fast" if kind == FAST_KERNEL else "General"
    return f"{short}<{','.join(args)}>" if args is not None else None


def device_hardware(name: str) -> dict:
    """The occupancy figures of a modelled device (register file, warps, blocks, shared memory)."""
    dev = MODELLED_DEVICES[name]
    hw = dict(HARDWARE.get(dev["arch"], HARDWARE[90]))
    hw.update(gpu=name, sms=dev["sms"], max_warps_per_sm=dev["max_threads_per_sm"] // 32,
              max_blocks_per_sm=dev["max_blocks_per_sm"])
    return hw


def loads_at_first_wait(loop: dict) -> int:
    """The q/k loads that the design targets count: the fewest outstanding at any token's first
    wait (first_stall_loads); the loop's maximum outstanding where no wait was found."""
    stalls = loop.get("first_stall_loads")
    return min(stalls) if stalls else loop["in_flight"]["max_qk_loads_128"]


def launch_figures(inst: dict, launch: dict, problem: dict, occ: dict) -> dict:
    """What one launch of `inst` does per thread along the common path: tokens per row group,
    whole-kernel instructions per element (one loop iteration per tokens-per-iteration, plus the
    prologue and epilogue amortised over the group's tokens), and the q/k bytes outstanding per SM
    at a token's first wait (fewest 128-bit loads at any token's first wait x 16 B x resident
    threads)."""
    loop = inst["hot_loop"]
    common = loop.get("common_path") or {}
    roles = inst["roles"]
    rows = int(roles.get("rows", 1))
    eb = inst["elem_bytes"]
    vec = 16 // eb
    head_dim = int(roles.get("head_dim", QWEN_HEAD_DIM))
    lanes = min(head_dim // vec, 32)
    elems = head_dim // lanes
    units = 2 * math.ceil(problem["heads"] / rows)
    token_step = launch["grid"][0] * (256 // lanes) // units
    tokens_per_group = problem["tokens"] / token_step
    per_iter = loop["elements_per_iteration"] / (rows * elems)   # tokens per loop iteration
    it, pro, epi = common.get("iteration"), common.get("prologue"), common.get("epilogue")
    ipe = None
    if it and pro is not None and epi is not None:
        ipe = (tokens_per_group * it / per_iter + pro + epi) / (tokens_per_group * rows * elems)
    at_wait = loads_at_first_wait(loop)
    in_flight = at_wait * 16 * occ["threads_per_sm"]
    return {"rows": rows, "grid": launch["grid"][0], "token_step": token_step,
            "tokens_per_group": tokens_per_group, "instr_per_element": ipe,
            "loop_instr_per_element": it / loop["elements_per_iteration"] if it else None,
            "prologue": pro, "epilogue": epi, "loads_at_first_wait": at_wait,
            "bytes_in_flight_per_sm": in_flight, "blocks_per_sm": occ["blocks_per_sm"]}


def plan_launches(report: dict, simt_lib: str | None = None) -> list[dict]:
    """Run the real launcher (qknorm_rope.cu under the SIMT emulation, dry run: nothing computed)
    against each modelled device for each Qwen problem and rounding mode, with each instance's
    occupancy from the ptxas registers of the build for that device's architecture (sm_90's where
    that architecture was not compiled), and analyse the instance it launches."""
    from qkrope.runtime import kernels
    default_build = ROOT / "build" / "kernel-simt" / kernels.SIMT_LIB_NAME
    if not simt_lib and kernels.simt_library_path() is None and default_build.is_file():
        simt_lib = str(default_build)
    saved = os.environ.get(kernels.SIMT_LIB_ENV)
    if simt_lib:
        os.environ[kernels.SIMT_LIB_ENV] = simt_lib  # for the loader only: restored below
    try:
        if kernels.simt_library_path() is None:
            raise ToolError("the SIMT emulation library is not built: " + kernels.SIMT_BUILD_COMMAND)
        return _plan_launches(report, kernels)
    finally:
        if saved is None:
            os.environ.pop(kernels.SIMT_LIB_ENV, None)
        else:
            os.environ[kernels.SIMT_LIB_ENV] = saved


def _plan_launches(report: dict, kernels) -> list[dict]:
    import torch

    entries = {int(a): e for a, e in report["archs"].items()}
    if not entries:
        return []
    symbols = kernels.simt_kernel_symbols("qkNormRope")
    simt_names = {}
    for name in symbols:
        if name.startswith("void ") and "lambda" not in name:
            label = _label_of(name)
            if label:
                simt_names[label] = name
    launches = []
    for dev_name, dev in MODELLED_DEVICES.items():
        arch = dev["arch"] if dev["arch"] in entries else (90 if 90 in entries else min(entries))
        by_label = {i["label"]: i for i in entries[arch]["instances"]}
        hw = device_hardware(dev_name)
        occ = {label: occupancy(i["regs"], i["smem"], i["threads_per_block"], hw) for label, i in by_label.items()}
        table = {simt_names[label]: o["blocks_per_sm"] for label, o in occ.items() if label in simt_names}
        kernels.simt_configure_model(num_sms=dev["sms"], max_threads_per_sm=dev["max_threads_per_sm"],
                                     compute_capability=dev["cc"], clock_khz=dev["clock_khz"],
                                     mem_clock_khz=dev["mem_clock_khz"], bus_width_bits=dev["bus_width_bits"],
                                     occupancy=table, dry_run=True)
        try:
            for prob in qwen_problems():
                q = torch.zeros(prob["batch"], prob["seq"], QWEN_HEADS, QWEN_HEAD_DIM, dtype=torch.bfloat16)
                k = torch.zeros_like(q)
                w = torch.ones(QWEN_HEAD_DIM, dtype=torch.bfloat16)
                cache = torch.zeros(prob["seq"], QWEN_HEAD_DIM)
                for rounding in (0, 1):
                    kernels.simt_reset()
                    kernels.simt_qk_norm_rope(q, k, w, w, cache, interleaved=True, rounding=rounding,
                                              out=(q, k))
                    recs = kernels.simt_last_launches()
                    if len(recs) != 1:
                        raise ToolError(f"{dev_name}, {prob['stream']}: expected one launch, got {len(recs)}")
                    label = _label_of(recs[0]["kernel"])
                    inst = by_label.get(label)
                    problem = dict(prob, heads=QWEN_HEADS)
                    row = {"device": dev_name, "arch": arch, "stream": prob["stream"], "batch": prob["batch"],
                           "tokens": prob["tokens"], "rounding": rounding, "instance": label,
                           "found": inst is not None}
                    if inst is not None and inst["hot_loop"].get("found"):
                        row.update(launch_figures(inst, recs[0], problem, occ[label]))
                    launches.append(row)
        finally:
            kernels.simt_configure(dry_run=False)
    return launches


def launch_checks(launches: list[dict]) -> list[dict]:
    """The static targets (LAUNCH_TARGETS) for every launch on a TARGET_ARCHS device."""
    checks = []
    for ln in launches:
        if ln["arch"] not in TARGET_ARCHS or MODELLED_DEVICES[ln["device"]]["arch"] not in TARGET_ARCHS:
            continue
        t = launch_target(ln["tokens"])
        where = f"{ln['device']}, {ln['stream']}, batch {ln['batch']}, rounding {ln['rounding']}"
        if not ln["found"] or "instr_per_element" not in ln:
            checks.append({"check": "launched-instance", "arch": ln["arch"], "instance": str(ln["instance"]),
                           "ok": False, "detail": f"{where}: the launched instance is not in the SASS"})
            continue
        need_b, have_b = t["bytes_in_flight_per_sm"], ln["bytes_in_flight_per_sm"]
        checks.append({"check": "launched-bytes-in-flight", "arch": ln["arch"], "instance": ln["instance"],
                       "ok": have_b >= need_b,
                       "detail": f"{where}: {have_b / 1024:.1f} KiB per SM at a token's first wait "
                                 f"({ln['loads_at_first_wait']} x 16 B x {ln['blocks_per_sm'] * 256} threads) "
                                 f"{'>=' if have_b >= need_b else '<'} {need_b // 1024} KiB"})
        lim, ipe = t["instr_per_element"][ln["rounding"]], ln["instr_per_element"]
        ok = ipe is not None and ipe <= lim
        checks.append({"check": "launched-instr-per-element", "arch": ln["arch"], "instance": ln["instance"],
                       "ok": ok, "detail": f"{where}: {_fmt(ipe, '.2f')} {'<=' if ok else '>'} {lim} "
                                           f"instructions per element ({ln['tokens_per_group']:.1f} tokens "
                                           "per group)"})
    return checks


def structural_checks(instances: list[dict]) -> list[dict]:
    """The facts that must not drift. One entry per (check, instance): name, label, arch, ok, detail."""
    checks = []

    def add(name, inst, ok, detail):
        checks.append({"check": name, "arch": inst["arch"], "instance": inst["label"], "ok": bool(ok),
                       "detail": detail})

    for inst in instances:
        if inst["kind"] != "fast":
            continue
        loop = inst["hot_loop"]
        if not loop.get("found"):
            add("qk-128bit", inst, False, "no hot loop with global stores found")
        else:
            ops = loop["memory_ops"]
            loads = [o for o in ops if o["kind"] == "load" and not o["constant"]]
            stores = [o for o in ops if o["kind"] == "store"]
            bad = [o["sass"] for o in loads + stores if o["width"] != 128]
            missing = [w for w, lst in (("q/k load", loads), ("store", stores)) if not lst]
            detail = (f"{len(loads)} q/k loads, {len(stores)} stores in the hot loop"
                      + (f"; narrower: {bad}" if bad else "") + (f"; no {missing}" if missing else ""))
            add("qk-128bit", inst, not bad and not missing, detail)
        spills = (inst["spill_stores"] or 0) + (inst["spill_loads"] or 0)
        local = inst["local"] or 0
        ok = spills == 0 and local == 0 and not inst["local_memory_sass"]
        add("no-spills", inst, ok,
            f"spill stores/loads {inst['spill_stores']}/{inst['spill_loads']} B, local {inst['local']} B, "
            f"LDL/STL in SASS: {len(inst['local_memory_sass'])}")
        add("store-default-policy", inst, not inst["store_policies"],
            "STG qualifiers " + (",".join(inst["store_policies"]) if inst["store_policies"] else "default"))
        if inst["qwen"]:
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


# =============================================================================================
# Output
# =============================================================================================

def _fmt(v, spec="", none="-"):
    return none if v is None else format(v, spec)


MAX_FAILURES_LISTED = 8


def _natural(label: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", label)]


def format_text(report: dict, details: str = "qwen") -> str:
    out: list[str] = []
    w = out.append
    for arch, entry in report["archs"].items():
        hw = entry["hardware"]
        w(f"== sm_{arch}  ({entry['cubin']}; hardware figures: {hw['gpu']})")
        for k, names in entry["param_names"].items():
            w(f"   {k}<{', '.join(names)}>  [{entry['param_origin'].get(k, '')}]")
        if not entry["ptxas"]:
            w("   no ptxas log (--cubin): registers/stack/shared from cuobjdump -res-usage, spills "
              "from LDL/STL in the SASS only")
        w("")
        hdr = (f"   {'instance':<34} {'regs':>4} {'spill st/ld':>11} {'stack':>5} {'smem':>6} "
               f"{'thr/blk':>7} {'blk/SM':>6} {'occ':>5} {'hot loop':>13} {'insns':>5} {'skip':>4} "
               f"{'el/it':>5} {'ins/el':>6} {'longest':>7} {'ld128':>5} {'KB/SM':>6}")
        w(hdr)
        for inst in entry["instances"]:
            lp = inst["hot_loop"]
            occ = inst["occupancy"]
            spill = f"{_fmt(inst['spill_stores'])}/{_fmt(inst['spill_loads'])}"
            label = inst["label"] + (" *Qwen" if inst["qwen"] else "")
            if lp.get("found"):
                rng = f"{lp['head']}-{lp['end'][2:]}"
                inflight = lp["in_flight"]["max_qk_loads_128"]
                kb = inflight * 16 * occ["threads_per_sm"] / 1024
                loopcols = (f"{rng:>13} {lp['instructions']:>5} {lp['skipped_instructions']:>4} "
                            f"{_fmt(lp['elements_per_iteration'], '.0f'):>5} "
                            f"{_fmt(lp['instr_per_element'], '.2f'):>6} "
                            f"{_fmt(lp['longest_path_per_element'], '.2f'):>7} {inflight:>5} {kb:>6.1f}")
            else:
                loopcols = f"{'(none)':>13}"
            w(f"   {label:<34} {inst['regs']:>4} {spill:>11} {_fmt(inst['stack']):>5} {inst['smem']:>6} "
              f"{inst['threads_per_block']:>7} {occ['blocks_per_sm']:>6} {occ['occupancy'] * 100:>4.0f}% "
              + loopcols)
        w("   columns: spill in bytes (ptxas); occ = resident warps / 64; hot loop = SASS address range; "
          "insns = non-NOP instructions in it;")
        w("   skip = of those, ones a forward branch jumps over; el/it = elements stored per iteration; "
          "ins/el = insns / el/it;")
        w("   longest = instructions on the longest head-to-back-edge path per element; ld128 = max "
          "128-bit q/k loads in flight per thread;")
        w("   KB/SM = ld128 x 16 B x resident threads per SM")
        w("")
        for inst in entry["instances"]:
            if inst["kind"] == "general" or not inst["hot_loop"].get("found"):
                continue
            if not (details == "all" or (details == "qwen" and inst["qwen"])):
                continue
            lp = inst["hot_loop"]
            params = ", ".join(f"{k}={v}" for k, v in inst["template_params"].items())
            w(f"   -- {inst['label']}  ({params}){'  [Qwen instance]' if inst['qwen'] else ''}")
            w(f"      occupancy {inst['occupancy']['blocks_per_sm']} blocks x {inst['threads_per_block']} "
              f"threads ({inst['threads_source']}), limited by {inst['occupancy']['limiter']}; "
              f"{inst['regs']} registers")
            w(f"      hot loop {lp['head']}..{lp['end']}: {lp['instructions']} instructions "
              f"({lp['skipped_instructions']} in conditionally skipped blocks), {lp['stores_128']} x "
              f"STG.128 -> {lp['elements_per_iteration']:.0f} elements/iteration -> "
              f"{_fmt(lp['instr_per_element'], '.2f')} instructions/element "
              f"(longest path {_fmt(lp['longest_path_per_element'], '.2f')})")
            if inst["threshold"] is not None:
                w(f"      threshold {inst['threshold']}: {inst['threshold_note']}")
            mix = lp["mix"]["categories"]
            w("      mix: " + ", ".join(f"{k} {v}" for k, v in mix.items()))
            if lp["calls"]:
                where = ("all targets outside the loop" if lp["calls_outside_loop"]
                         else "SOME TARGETS INSIDE THE LOOP: the count includes them")
                w(f"      calls in the loop (cold subroutines, only the CALL counted): {len(lp['calls'])}, {where}")
            w("      global memory in the hot loop:")
            for o in lp["memory_ops"]:
                w(f"        {o['addr']}  {o['kind']:<5} {o['width']:>3}-bit  "
                  f"{'.'.join(o['qualifiers']) or '-':<14} {o['sass']}")
            fl = lp["in_flight"]
            w(f"      loads in flight per thread: {fl['max_qk_loads_128']} x 128-bit q/k "
              f"(max {fl['max_bytes_per_thread']} B of global loads outstanding)")
            b = inst.get("bounds")
            if b:
                w(f"      bound ({report['problem']['name']}):")
                w(f"        memory floor   {b['bytes'] / 1e6:.1f} MB at {hw['dram_tb_s']} TB/s = "
                  f"{b['memory_floor_us']:.1f} us")
                if "issue_floor_us" in b:
                    w(f"        issue floor    {b['elements'] / 1e6:.1f} M elements / 32 x "
                      f"{lp['instr_per_element']:.2f} = {b['warp_instructions'] / 1e6:.1f} M warp-instr / "
                      f"({hw['sms']} SMs x {hw['schedulers_per_sm']} x {hw['clock_ghz']} GHz) = "
                      f"{b['issue_floor_us']:.1f} us  -> {b['bound']}-bound, at best "
                      f"{b['fraction_of_peak_bw'] * 100:.0f} % of peak bandwidth "
                      f"(break-even {b['break_even_instr_per_element']:.1f} instructions/element)")
                w(f"        in flight      {b['bytes_in_flight_per_sm'] / 1024:.1f} KB per SM at a "
                  f"token's first wait ({loads_at_first_wait(lp)} x 16 B x "
                  f"{inst['occupancy']['threads_per_sm']} threads) vs "
                  f"{b['bytes_in_flight_needed_per_sm'] / 1024:.1f} KB needed ({hw['dram_tb_s']} TB/s x "
                  f"{hw['dram_latency_ns']} ns / {hw['sms']} SMs): ratio {b['in_flight_ratio']:.2f}, "
                  f"latency caps reads at ~{b['latency_bound_read_tb_s']:.1f} TB/s")
            w("")
        w("   assumptions:")
        for a in entry["assumptions"]:
            w(f"     - {a}")
        w("")
    if report.get("launches"):
        w("== launches: the real launcher (qknorm_rope.cu under the SIMT emulation, dry run) on "
          "modelled devices, occupancy from ptxas registers")
        w(f"   {'device':<14} {'stream':<16} {'batch':>5} {'rnd':>3} {'instance':<30} {'blk/SM':>6} "
          f"{'tok/grp':>7} {'ins/el':>6} {'ld@wait':>7} {'KiB/SM':>6}")
        for ln in report["launches"]:
            if "instr_per_element" not in ln:
                w(f"   {ln['device']:<14} {ln['stream']:<16} {ln['batch']:>5} {ln['rounding']:>3} "
                  f"{str(ln['instance']):<30} (not in the SASS)")
                continue
            w(f"   {ln['device']:<14} {ln['stream']:<16} {ln['batch']:>5} {ln['rounding']:>3} "
              f"{ln['instance']:<30} {ln['blocks_per_sm']:>6} {ln['tokens_per_group']:>7.1f} "
              f"{_fmt(ln['instr_per_element'], '.2f'):>6} {ln['loads_at_first_wait']:>7} "
              f"{ln['bytes_in_flight_per_sm'] / 1024:>6.1f}")
        w("   ins/el = common-path SASS instructions per element over the whole kernel (loop per "
          "token + prologue/epilogue over tok/grp tokens);")
        w("   ld@wait = 128-bit q/k loads outstanding at a token's first wait; KiB/SM = ld@wait x 16 B "
          "x resident threads")
        w(f"   targets on {', '.join(f'sm_{a}' for a in TARGET_ARCHS)} devices: " + "; ".join(
            f">= {t['min_tokens']} tokens: >= {t['bytes_in_flight_per_sm'] // 1024} KiB, <= "
            f"{t['instr_per_element'][0]} / {t['instr_per_element'][1]} (rounding 0 / 1)" for t in LAUNCH_TARGETS))
        w("")
    w(f"== structural checks (--check); instruction thresholds {THRESHOLDS} by rounding mode, "
      f"from {THRESHOLD_SOURCE}")
    by = collections.OrderedDict()
    for c in report["checks"]:
        by.setdefault((c["arch"], c["check"]), []).append(c)
    for (arch, name), cs in by.items():
        bad = [c for c in cs if not c["ok"]]
        w(f"   sm_{arch} {name:<22} {'ok' if not bad else 'FAIL'}  ({len(cs) - len(bad)}/{len(cs)} instances)")
        for c in bad[:MAX_FAILURES_LISTED]:
            w(f"      FAIL {c['instance']}: {c['detail']}")
        if len(bad) > MAX_FAILURES_LISTED:
            w(f"      ... and {len(bad) - MAX_FAILURES_LISTED} more (all in --json)")
        if name == "instr-per-element" and not bad:
            for c in cs:
                w(f"      {c['instance']}: {c['detail']}")
    return "\n".join(out)


def _json_ready(report: dict) -> dict:
    return json.loads(json.dumps(report, default=str))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default=None,
                    help="comma-separated SM versions to compile for (default 90,100); with --cubin, "
                         "a filter")
    ap.add_argument("--cubin", action="append", help="analyse this cubin instead of compiling (repeatable)")
    ap.add_argument("--source", default=str(SOURCE), help="the kernel source (default %(default)s)")
    ap.add_argument("--out-dir", default=str(BUILD_DIR), help="build folder (default %(default)s)")
    ap.add_argument("--nvcc", help="nvcc to use (default: $CUDACXX, PATH, /usr/local/cuda/bin)")
    ap.add_argument("--cuobjdump", help="cuobjdump to use (default: PATH, CUDA, the PyPI wheel)")
    ap.add_argument("--nvdisasm", help="nvdisasm to use (default: PATH, CUDA, the PyPI wheel)")
    ap.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    ap.add_argument("--details", choices=("none", "qwen", "all"), default="qwen",
                    help="per-instance detail blocks: Qwen and failing instances (default), all, none")
    ap.add_argument("--check", action="store_true", help="exit 1 when a structural fact fails")
    ap.add_argument("--no-launches", action="store_true",
                    help="skip running the real launcher against the modelled devices (it needs the SIMT "
                         "emulation library: " + "cmake -S plugins/kernel -B build/kernel-simt && cmake --build "
                         "build/kernel-simt --target qkrope_kernels_simt)")
    ap.add_argument("--simt-lib", help="the SIMT emulation library (default: $QKROPE_KERNELS_SIMT_LIB, "
                                       "build/kernel-simt, build/plugins)")
    args = ap.parse_args(argv)
    args.archs = None
    if args.arch is not None:
        try:
            args.archs = [int(a.strip().removeprefix("sm_")) for a in args.arch.split(",") if a.strip()]
        except ValueError:
            ap.error(f"--arch: expected e.g. 90,100, got {args.arch!r}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        report = build_report(args.archs, cubins=args.cubin, nvcc=args.nvcc, cuobjdump=args.cuobjdump,
                              nvdisasm=args.nvdisasm, source=Path(args.source), out_dir=Path(args.out_dir),
                              launches=not args.no_launches, simt_lib=args.simt_lib)
    except ToolError as e:
        print(f"kernel_report: error: {e}", file=sys.stderr)
        return 2
    print(format_text(report, details=args.details))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(_json_ready(report), indent=1) + "\n")
    if args.check and not report["ok"]:
        bad = sum(not c["ok"] for c in report["checks"])
        print(f"kernel_report: {bad} structural check(s) failed", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
