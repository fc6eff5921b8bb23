"""A reader of NVIDIA SASS: what a compiled kernel executes, from ``cuobjdump -sass``.

==============  ==============================================================================
module          subject
==============  ==============================================================================
instructions    :class:`Instr` (one instruction: predicate, opcode, modifiers, width, registers)
                and :func:`parse_sass` (the listing -> instructions per function)
flow            the control flow: reachability, loops, the hot loop, the cold code off the
                common path, and the instruction counts along it (:func:`common_path_counts`)
loads           the loads a hot loop keeps outstanding (at each token's first wait too), its
                instruction mix and memory accesses, :func:`analyse_loop`
scoreboards     what the hardware waits on: the control bits' scoreboards, wait masks and
                ``DEPBAR.LE``; the global bytes still outstanding at each wait of a loop
                (:func:`scoreboard_waits`, :func:`wait_summary`)
tools           :class:`Tools` (cuobjdump, nvdisasm, c++filt) and the parsers of ``ptxas -v``,
                ``cuobjdump -res-usage`` and ``cuobjdump -elf``
==============  ==============================================================================

A kernel-analysis tool, not part of the inference library: it lives with its one user, the
kernel's static report (:mod:`qkrope.apps.kernel_report`, ``scripts/kernel_report.py``), which
reads the kernel through it; the figures are the test oracle of ``tests/test_kernel_report.py``.
"""
from __future__ import annotations

from .flow import (cold_addresses, common_path_counts, find_hot_loop, find_loops, longest_path,
                   loop_body, reachable, skipped_addresses)
from .instructions import (CONSTANT_QUALIFIER, GLOBAL_LOADS, GLOBAL_STORES, LOCAL_OPS,
                           STORE_POLICY_QUALIFIERS, Control, Instr, decode_control, parse_sass)
from .loads import (analyse_loop, first_stall_loads, instruction_mix, loads_at_first_wait,
                    loads_in_flight, memory_ops, outstanding_at_waits)
from .scoreboards import scoreboard_waits, wait_summary
from .tools import FIXES, ToolError, Tools, parse_max_threads, parse_ptxas, parse_res_usage

__all__ = [
    "Instr", "Control", "decode_control", "parse_sass", "scoreboard_waits", "wait_summary", "CONSTANT_QUALIFIER", "STORE_POLICY_QUALIFIERS", "GLOBAL_LOADS",
    "GLOBAL_STORES", "LOCAL_OPS",
    "reachable", "find_loops", "loop_body", "find_hot_loop", "skipped_addresses", "longest_path",
    "cold_addresses", "common_path_counts",
    "loads_in_flight", "first_stall_loads", "loads_at_first_wait", "instruction_mix", "memory_ops",
    "analyse_loop", "outstanding_at_waits",
    "FIXES", "ToolError", "Tools", "parse_ptxas", "parse_res_usage", "parse_max_threads",
]
