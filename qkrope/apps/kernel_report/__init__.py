"""The static performance report of the CUDA kernel (``scripts/kernel_report.py`` runs it).

It compiles ``plugins/kernel/qknorm_rope.cu`` for sm_90 (and sm_100), reads ptxas and the SASS
through :mod:`qkrope.apps.kernel_report.sass` (registers, spills, occupancy, the hot loop's memory accesses,
the instruction counts along the common path, the q/k loads outstanding at each token's first
wait), runs the real launcher under the SIMT emulation against modelled devices for every family
record's launches, and checks the facts that must not drift.

===========  ===================================================================================
module       subject
===========  ===================================================================================
assumptions  the hardware figures, the problem, thresholds, modelled devices, launch targets;
             occupancy and the issue/memory floors computed from them
instances    compiling the kernel; naming, classifying and analysing each kernel instance
launches     the real launcher on the modelled devices (dry run) and the launch targets' checks
report       :func:`build_report` (the whole report as one dict) and the structural checks
text         :func:`format_text` (the report as text) and :func:`json_ready`
===========  ===================================================================================
"""
from __future__ import annotations

from .assumptions import (HARDWARE, LAUNCH_TARGETS, MODELLED_DEVICES, PROBLEM, ROUNDING2_COST,
                          STEADY_TOKENS_PER_GROUP, TARGET_ARCHS, THRESHOLD_SOURCE, THRESHOLDS,
                          assumptions, device_hardware, launch_problems, launch_target, occupancy,
                          problem_bounds, reference_match)
from .instances import (BUILD_DIR, DEFAULT_ARCHS, ELEMENT_BYTES, FALLBACK_PARAMS, FAST_KERNEL,
                        GENERAL_KERNEL, PARAM_ROLES, REFERENCE_MATCH, SOURCE, analyse_cubin,
                        analyse_function, compile_cubins, is_reference, label_of, read_param_names,
                        role_values, rounding_value, template_args)
from .launches import launch_checks, launch_figures, plan_launches
from .report import build_report, structural_checks
from .sass import ToolError, Tools
from .text import MAX_FAILURES_LISTED, fmt, format_text, json_ready

__all__ = [
    "ToolError", "Tools",
    "HARDWARE", "PROBLEM", "THRESHOLDS", "THRESHOLD_SOURCE", "MODELLED_DEVICES",
    "ROUNDING2_COST", "LAUNCH_TARGETS", "STEADY_TOKENS_PER_GROUP",
    "TARGET_ARCHS", "launch_target", "launch_problems",
    "occupancy", "device_hardware", "problem_bounds", "reference_match",
    "assumptions",
    "SOURCE", "BUILD_DIR", "DEFAULT_ARCHS", "FAST_KERNEL", "GENERAL_KERNEL", "FALLBACK_PARAMS",
    "PARAM_ROLES", "REFERENCE_MATCH", "ELEMENT_BYTES", "compile_cubins", "read_param_names",
    "template_args", "role_values", "is_reference", "rounding_value", "analyse_function",
    "analyse_cubin", "label_of",
    "launch_figures", "plan_launches", "launch_checks",
    "structural_checks", "build_report",
    "MAX_FAILURES_LISTED", "fmt", "format_text", "json_ready",
]
