"""The SIMT emulation of the kernel, shared by its test files: the build (cmake on plugins/kernel
into build/kernel-simt, -DQKROPE_WITH_CUDA=OFF, unless QKROPE_KERNELS_SIMT_LIB names a library
already built), the device fixtures, and one emulated run checked bit for bit against the CPU
build (libqkrope_kernel_host.so) inside sentinel-filled guard bands."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from _kernel_cases import assert_bit_exact, check_against_fp32, make_inputs, row_weights
from _native import SIMT_BUILD_DIR, build_simt, require_native_tools
from qkrope.runtime import kernels

REPO = Path(__file__).resolve().parent.parent
BUILD_DIR = SIMT_BUILD_DIR
KERNEL_SRC = REPO / "plugins" / "kernel"
SIMT_SRC = REPO / "plugins" / "simt"

# The CPU build sums squares in the kernel's order (qknorm_rope_plan.h SumLayout), so random
# inputs agree bit for bit too, not only the grid inputs (exact sums of squares).

DEFAULT_DEVICE = dict(num_sms=2, blocks_per_sm=2, seed=0)
# The emulator's default device model (simt.h DeviceConfig: an sm_90 part's clocks and bus) and a
# bandwidth-starved one (an A100's bandwidth and clock per SM, on 2 SMs): on the second the launch
# plan's memory term picks one row per unit for single-head problems, which the default's
# per-SM bandwidth never does, so the probes reach every compiled instance.
DEVICE_MODELS = {
    "default": dict(num_sms=2, max_threads_per_sm=2048, compute_capability=(9, 0), clock_khz=1980000,
                    mem_clock_khz=2619000, bus_width_bits=5120),
    "bandwidth-starved": dict(num_sms=2, max_threads_per_sm=2048, compute_capability=(8, 0),
                              clock_khz=1410000, mem_clock_khz=29500, bus_width_bits=5120),
}


def use_device(model: str = "default", dry_run: bool = False) -> None:
    kernels.simt_configure_model(**DEVICE_MODELS[model], dry_run=dry_run)
    kernels.simt_configure(**DEFAULT_DEVICE, dry_run=dry_run)
SENTINEL = {2: 0xFFFF, 4: 0xFFFFFFFF}  # NaNs with payloads no conversion or fp32 op produces
GUARD = 64                             # elements before and after each output (keeps 16-byte alignment)


# ---- build ------------------------------------------------------------------------------------------
def _tools():
    return require_native_tools("the SIMT emulation")


def _build() -> Path:
    return build_simt(("qkrope_kernels_simt", "simt_selftest", "qkrope_kernel_host"))


@pytest.fixture(scope="module")
def libs():
    explicit = os.environ.get(kernels.SIMT_LIB_ENV)
    with pytest.MonkeyPatch.context() as mp:
        if explicit:
            d = Path(explicit).parent
        else:
            d = _build()
            mp.setenv(kernels.SIMT_LIB_ENV, str(d / kernels.SIMT_LIB_NAME))
        if not os.environ.get(kernels.HOST_LIB_ENV):
            mp.setenv(kernels.HOST_LIB_ENV, str(d / kernels.HOST_LIB_NAME))
        kernels.simt_configure(**DEFAULT_DEVICE, dry_run=False)
        yield d
        kernels.simt_configure(**DEFAULT_DEVICE, dry_run=False)


@pytest.fixture()
def device(libs):
    """Restores the default device shape and scheduling after a test that changes them."""
    use_device()
    kernels.simt_reset()
    yield
    use_device()


# ---- one emulated run, checked against the CPU build ---------------------------------------------------
def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _offset_copy(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of t whose data pointer is one element past an aligned allocation."""
    base = torch.empty(t.numel() + 1, dtype=t.dtype)
    view = base[1:].view(t.shape)
    view.copy_(t)
    return view


def _guarded(like: torch.Tensor, *, misalign: bool = False):
    """(buffer, view): an output view of like's shape inside a sentinel-filled buffer."""
    n = like.numel()
    start = GUARD + (1 if misalign else 0)
    buf = torch.empty(n + 2 * GUARD + 1, dtype=like.dtype)
    _bits(buf).fill_(SENTINEL[like.element_size()] - (1 << (8 * like.element_size())))
    return buf, buf[start:start + n].view(like.shape), start


def _check_guarded(name, buf, view, start):
    sentinel = SENTINEL[view.element_size()] - (1 << (8 * view.element_size()))
    bits = _bits(buf)
    outside = torch.cat([bits[:start], bits[start + view.numel():]])
    assert bool((outside == sentinel).all()), f"{name}: an element outside the output was written"
    left = int((_bits(view) == sentinel).sum())
    assert left == 0, (f"{name}: {left} of {view.numel()} output elements were never written "
                       f"(first at {tuple((_bits(view) == sentinel).nonzero()[0].tolist())})")


def run_checked(dtype, head_dim, rotary_dim, *, interleaved=True, rounding=0, batch=1, seq=3,
                heads=2, grid=True, seed=0, misalign=(), in_place=False, check_fp32=False,
                norm_scope=0, weights_fp32=False):
    """Runs the emulated kernel and the CPU build on the same inputs; asserts bit-exact outputs,
    no unwritten element and untouched guard bands. Returns the emulated launches. norm_scope 1
    runs the row-scope op ([heads * head_dim] weights); weights_fp32 gives float32 weights."""
    inputs = make_inputs(dtype, head_dim, rotary_dim, batch=batch, seq=seq, heads=heads,
                         grid=grid, seed=seed, weights_fp32=weights_fp32)
    inputs = list(row_weights(inputs) if norm_scope == 1 else inputs)
    names = ("q", "k", "q_weight", "k_weight", "cache")
    for i, n in enumerate(names):
        if n in misalign:
            inputs[i] = _offset_copy(inputs[i])
    kw = dict(interleaved=interleaved, rounding=rounding, norm_scope=norm_scope)
    # the CPU build sees the same pointers' alignment (it picks the kernel path's sum order)
    _, hq, _ = _guarded(inputs[0], misalign="q_out" in misalign)
    _, hk, _ = _guarded(inputs[1], misalign="k_out" in misalign)
    expected = kernels.host_qk_norm_rope(*inputs, out=(hq, hk), **kw)
    kernels.simt_reset()
    if in_place:
        q, k = inputs[0].clone(), inputs[1].clone()
        outs = kernels.simt_qk_norm_rope(q, k, *inputs[2:], out=(q, k), **kw)
        assert outs[0] is q and outs[1] is k
    else:
        qb, qv, qs = _guarded(inputs[0], misalign="q_out" in misalign)
        kb, kv, ks = _guarded(inputs[1], misalign="k_out" in misalign)
        outs = kernels.simt_qk_norm_rope(*inputs, out=(qv, kv), **kw)
        _check_guarded("q_out", qb, qv, qs)
        _check_guarded("k_out", kb, kv, ks)
    launches = kernels.simt_last_launches()
    assert launches and all(rec["status"] == 0 for rec in launches), launches
    assert_bit_exact(outs, expected)
    for o, e in zip(outs, expected):
        finite = ~o.isnan()
        assert torch.equal(_bits(o)[finite], _bits(e)[finite]), "raw bits differ (signed zeros?)"
    if check_fp32:
        check_against_fp32(outs, inputs, dtype, interleaved, norm_scope=norm_scope)
    return launches


def _template(kernel_name: str) -> str:
    """'void ns::f<A, B>(Args)' -> 'ns::f' (the template, without its arguments)."""
    head = kernel_name.split("<")[0] if "<" in kernel_name else kernel_name.split("(")[0]
    return head[5:] if head.startswith("void ") else head


def _instance(kernel_name: str) -> str:
    """'void ns::f<A, B>(Args)' -> 'ns::f<A, B>' (the parameter list is the last balanced (...))."""
    name = kernel_name[5:] if kernel_name.startswith("void ") else kernel_name
    if name.endswith(")"):
        depth = 0
        for i in range(len(name) - 1, -1, -1):
            depth += {")": 1, "(": -1}.get(name[i], 0)
            if depth == 0:
                return name[:i]
    return name
