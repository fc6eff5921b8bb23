"""Reading a compiled kernel with the CUDA tools: :class:`Tools` (cuobjdump with nvdisasm, and
c++filt, found by :mod:`qkrope.runtime.toolchain`; a missing one is a :class:`ToolError` naming
the fix) and the parsers of what the tools print besides the SASS: ``ptxas -v`` (registers,
spills, stack, shared memory), ``cuobjdump -res-usage`` and ``cuobjdump -elf`` (the
``__launch_bounds__`` of each function)."""
from __future__ import annotations

import os
import re
import subprocess

from qkrope.errors import QkropeError
from qkrope.runtime import toolchain

__all__ = ["FIXES", "ToolError", "Tools", "parse_ptxas", "parse_res_usage", "parse_max_threads"]

FIXES = {
    "nvcc": "install the CUDA toolkit (nvcc) or pass --nvcc PATH",
    "cuobjdump": "pip install nvidia-cuda-cuobjdump (a test extra: bash scripts/setup_env.sh), "
                 "or pass --cuobjdump PATH",
    "nvdisasm": "pip install nvidia-cuda-nvdisasm (a test extra: bash scripts/setup_env.sh); "
                "cuobjdump -sass runs it",
    "c++filt": "install binutils (c++filt)",
}


class ToolError(QkropeError, RuntimeError):
    """A tool is missing or failed; the message names it and the fix."""



class Tools:
    """The resolved tools; each missing one raises ToolError naming the fix when first needed."""

    def __init__(self, nvcc: str | None = None, cuobjdump: str | None = None,
                 nvdisasm: str | None = None, need_nvcc: bool = True):
        self.nvcc = toolchain.find_nvcc(nvcc) if need_nvcc or nvcc else None
        if need_nvcc and not self.nvcc:
            raise ToolError(f"nvcc not found{f' at {nvcc}' if nvcc else ''}: {FIXES['nvcc']}")
        self.cuobjdump = toolchain.find_cuda_tool("cuobjdump", cuobjdump, self.nvcc)
        if not self.cuobjdump:
            raise ToolError(f"cuobjdump not found{f' at {cuobjdump}' if cuobjdump else ''}: "
                            f"{FIXES['cuobjdump']}")
        self.nvdisasm = toolchain.find_cuda_tool("nvdisasm", nvdisasm, self.nvcc, beside=self.cuobjdump)
        if not self.nvdisasm:
            raise ToolError(f"nvdisasm not found: {FIXES['nvdisasm']}")
        self.cxxfilt = toolchain.find_cxxfilt()
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
