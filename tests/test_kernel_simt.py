"""The CUDA kernel and launcher (plugins/kernel/qknorm_rope.cu, unchanged) run on the CPU through
the SIMT emulation of plugins/simt: every CUDA thread a fiber, warp shuffles and barriers real
barriers between them (a lane that skips a shuffle is a reported deadlock, a wrong partner lane a
wrong result). Needs only g++ and cmake; the libraries are built here (cmake on plugins/kernel into
build/kernel-simt, -DQKROPE_WITH_CUDA=OFF) unless QKROPE_KERNELS_SIMT_LIB names one already built.

- every kernel instance compiled into the library is launched: the launcher's choice for a grid of
  problem shapes is probed with dry-run launches (recorded, not run), and for every instance in the
  library's symbol table the smallest problem that selects it is run for real;
- each run is compared bit for bit with the CPU build (libqkrope_kernel_host.so, the same maths in
  the kernel's summation order), with the outputs prefilled with a sentinel no conversion produces
  (none may survive) inside guard bands that must stay untouched;
- the small-problem split, grid-stride loops (a 1-SM device), in place, misaligned pointers, the
  Qwen-Image head layout, seeded scheduling orders, NaN rows;
- the emulator itself (shuffle semantics for every width against a model of the CUDA rules,
  deadlock / misuse reports, __syncthreads, __shared__, the device's conversions);
- mutants of the kernel source (compiled from a temporary copy) that the emulated checks catch and
  the CPU build cannot see.
"""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from _kernel_cases import assert_bit_exact, check_against_fp32, make_inputs
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
    return build_simt(("qkrope_kernels_simt", "qkrope_simt_selftest", "qkrope_kernel_host"))


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
                heads=2, grid=True, seed=0, misalign=(), in_place=False, check_fp32=False):
    """Runs the emulated kernel and the CPU build on the same inputs; asserts bit-exact outputs,
    no unwritten element and untouched guard bands. Returns the emulated launches."""
    inputs = list(make_inputs(dtype, head_dim, rotary_dim, batch=batch, seq=seq, heads=heads,
                              grid=grid, seed=seed))
    names = ("q", "k", "q_weight", "k_weight", "cache")
    for i, n in enumerate(names):
        if n in misalign:
            inputs[i] = _offset_copy(inputs[i])
    kw = dict(interleaved=interleaved, rounding=rounding)
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
        check_against_fp32(outs, inputs, dtype, interleaved)
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


# ---- the launcher's choices, probed with dry-run launches -----------------------------------------------
PROBE_HEAD_ROT = ((64, 64), (64, 32), (128, 128), (128, 64), (256, 256), (256, 128), (128, 40),
                  (48, 48), (96, 32), (200, 200), (320, 320))
PROBE_HEADS = (1, 2, 3, 4, 6, 8)
PROBE_TOKENS = ((1, 1), (1, 2), (1, 3), (1, 5), (2, 4), (1, 13), (2, 16), (4, 16), (8, 16))
PROBE_MISALIGN = ((), ("q",))


def _probe(lib, dtype, d, r, inter, rnd, heads, batch, seq, misalign, pool):
    esize = torch.tensor([], dtype=dtype).element_size()
    base = pool.data_ptr()
    n = batch * seq * heads * d * esize
    off = esize if misalign else 0
    q, k = base + 64 + off, base + 64 + n + 64
    qo, ko = base + 64 + 2 * (n + 64), base + 64 + 3 * (n + 64)
    w = base + 64 + 4 * (n + 64)
    cache = w + 2 * 512 * 4
    status = lib.qkrope_launch(q, k, w, w, cache, qo, ko, batch, seq, heads, d, r, seq, 1e-6,
                               int(inter), rnd, kernels.DTYPE_CODES[dtype], None)
    assert status == 0, status


@pytest.fixture(scope="module")
def plan(libs):
    """{instance: (problem, template)} -- for every instance the probes reached, the smallest
    problem that selects it -- and the instances compiled into the library."""
    lib = kernels._simt_lib()
    pool = torch.zeros(64 * 1024 * 1024 // 8, dtype=torch.float64)  # never read in dry-run mode
    found: dict[str, tuple] = {}
    try:
        for model in DEVICE_MODELS:
            use_device(model, dry_run=True)
            for dtype in (torch.float32, torch.float16, torch.bfloat16):
                for d, r in PROBE_HEAD_ROT:
                    for inter in (True, False):
                        for rnd in (0, 1):
                            for mis in PROBE_MISALIGN:
                                for heads in PROBE_HEADS:
                                    for batch, seq in PROBE_TOKENS:
                                        kernels.simt_reset()
                                        _probe(lib, dtype, d, r, inter, rnd, heads, batch, seq, mis, pool)
                                        (rec,) = kernels.simt_last_launches()
                                        inst = _instance(rec["kernel"])
                                        cost = batch * seq * heads * d
                                        prob = dict(dtype=dtype, head_dim=d, rotary_dim=r,
                                                    interleaved=inter, rounding=rnd, heads=heads,
                                                    batch=batch, seq=seq, misalign=mis, model=model)
                                        if inst not in found or cost < found[inst][0]:
                                            found[inst] = (cost, prob, _template(rec["kernel"]))
    finally:
        use_device()
        kernels.simt_reset()
    templates = {t for _, _, t in found.values()}
    compiled = set()
    for t in templates:
        short = t.split("::")[-1]
        # kernels are void function templates; lambdas inside them are symbols too (skipped)
        compiled |= {_instance(s) for s in kernels.simt_kernel_symbols(short + "<")
                     if s.startswith("void ") and _template(s) == t and "{lambda" not in s}
    return {i: (p, t) for i, (_, p, t) in found.items()}, compiled


def test_probes_reach_every_compiled_instance(plan):
    found, compiled = plan
    assert len({t for _, t in found.values()}) >= 2, "expected a fast and a general kernel template"
    missing = sorted(compiled - set(found))
    assert not missing, (f"{len(missing)} of {len(compiled)} kernel instances compiled into the "
                         f"library are selected by none of the probed problems (extend PROBE_*): "
                         + "; ".join(missing[:8]))


def _run_instances(found, dtype, grid):
    failures = []
    ran = set()
    for inst, (prob, _) in sorted(found.items()):
        if prob["dtype"] != dtype:
            continue
        p = dict(prob)
        p.pop("dtype")
        heads = p.pop("heads")
        batch, seq = p.pop("batch"), p.pop("seq")
        use_device(p.pop("model"))
        try:
            launches = run_checked(dtype, heads=heads, batch=batch, seq=seq, grid=grid, seed=3,
                                   **p)
            got = {_instance(rec["kernel"]) for rec in launches}
            assert got == {inst}, f"the launcher chose {got}, the dry run {inst}"
            ran.add(inst)
        except AssertionError as exc:
            failures.append(f"{inst} {prob}: {str(exc).splitlines()[0]}")
    use_device()
    assert not failures, f"{len(failures)} instance(s) failed:\n" + "\n".join(failures[:10])
    return ran


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
def test_every_instance_grid_inputs_bit_exact(plan, device, dtype):
    """Inputs with an exact sum of squares: bit-exact with the CPU build in every instance."""
    found, _ = plan
    ran = _run_instances(found, dtype, grid=True)
    assert ran, "no instance of this dtype was reached"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
def test_every_instance_random_inputs_bit_exact(plan, device, dtype):
    found, _ = plan
    _run_instances(found, dtype, grid=False)


def test_instance_variety(plan):
    """Data-driven shape of the coverage: several instances per template, and for every fast-path
    combination reached (dtype, head_dim, pairing) more than one instance (rows per unit, ...)."""
    found, _ = plan
    by_combo: dict[tuple, set] = {}
    for inst, (p, t) in found.items():
        by_combo.setdefault((t, p["dtype"], p["head_dim"], p["interleaved"]), set()).add(inst)
    for (t, dtype, d, inter), insts in by_combo.items():
        if d in (64, 128, 256) and len(by_combo) > 1 and "General" not in t:
            assert len(insts) > 1, f"{t} {dtype} d{d} interleaved={inter}: only {insts}"


# ---- scenarios ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("head_rot", [(64, 64), (128, 128), (256, 256), (128, 64), (48, 48),
                                      (96, 32), (128, 40)], ids=lambda hr: f"d{hr[0]}-rot{hr[1]}")
@pytest.mark.parametrize("interleaved", [True, False], ids=["gptj", "neox"])
def test_cases_grid_and_accuracy(device, dtype, head_rot, interleaved):
    d, r = head_rot
    for rounding in (0, 1):
        run_checked(dtype, d, r, interleaved=interleaved, rounding=rounding, batch=2, seq=3,
                    heads=3, grid=True, seed=7)
    # random inputs: accuracy against the fp32 reference always; bit-exactness: see below
    inputs = make_inputs(dtype, d, r, batch=2, seq=3, heads=3, seed=d + r)
    outs = kernels.simt_qk_norm_rope(*inputs, interleaved=interleaved)
    check_against_fp32(outs, inputs, dtype, interleaved)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16],
                         ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("interleaved", [True, False], ids=["gptj", "neox"])
def test_cases_random_bit_exact(device, dtype, interleaved):
    for d, r in ((64, 64), (128, 128), (256, 256), (128, 64), (48, 48), (96, 32)):
        for rounding in (0, 1):
            run_checked(dtype, d, r, interleaved=interleaved, rounding=rounding, batch=2, seq=3,
                        heads=3, grid=False, seed=d + r + rounding)


def test_small_problem_split(device):
    """One token with many heads on a device with SMs to spare: the launch plan spreads its rows
    over several blocks (on the default 2-SM device one block of 3-row units is its cheaper
    choice: the busiest SM then issues half the prologue)."""
    kernels.simt_configure(num_sms=8, blocks_per_sm=2)
    for d, interleaved in ((128, True), (96, True), (256, False)):
        launches = run_checked(torch.bfloat16, d, d, interleaved=interleaved, batch=1, seq=1,
                               heads=24)
        (rec,) = launches
        blocks = rec["grid"][0] * rec["grid"][1] * rec["grid"][2]
        assert blocks > 1, f"one token of 24 heads ran on a single block: {rec}"


@pytest.mark.parametrize("head_rot", [(128, 128), (64, 32), (96, 96), (256, 256)],
                         ids=lambda hr: f"d{hr[0]}-rot{hr[1]}")
def test_grid_stride_more_work_than_resident_blocks(device, head_rot):
    """A 1-SM device with one resident block: the grid cannot cover the problem, so every row
    group walks several tokens (and nothing is left unwritten)."""
    d, r = head_rot
    kernels.simt_configure(num_sms=1, blocks_per_sm=1)
    for dtype in (torch.bfloat16, torch.float32):
        launches = run_checked(dtype, d, r, batch=2, seq=20, heads=2, interleaved=(d != 256))
        (rec,) = launches
        blocks = rec["grid"][0] * rec["grid"][1] * rec["grid"][2]
        rows = 2 * 20 * 2 * 2
        assert rec["num_sms"] == 1 and rec["blocks_per_sm"] == 1
        assert blocks <= 1 * 1, f"more blocks than resident: {rec}"
        assert rows > 32 * blocks, "the problem must need more row-group passes than the grid has"


def test_in_place(device):
    for dtype, d, r, inter in ((torch.bfloat16, 128, 64, True), (torch.float16, 256, 256, False),
                               (torch.float32, 96, 96, False)):
        run_checked(dtype, d, r, interleaved=inter, batch=2, seq=3, heads=3, in_place=True)


@pytest.mark.parametrize("which", [("q",), ("k",), ("q_out",), ("k_out",), ("cache",),
                                   ("q_weight", "k_weight")], ids=lambda w: "+".join(w))
def test_misaligned_pointers(device, which):
    """A tensor one element off 16-byte alignment: a different (general-path) instance where the
    fast path would need the alignment, and the same results as the CPU build."""
    for dtype in (torch.bfloat16, torch.float32):
        aligned = run_checked(dtype, 128, 128, batch=1, seq=3, heads=2)
        shifted = run_checked(dtype, 128, 128, batch=1, seq=3, heads=2, misalign=which)
        if "q_weight" in which:
            # weights are read once per thread with scalar loads: q/k stay on the vector path
            assert _template(aligned[0]["kernel"]) == _template(shifted[0]["kernel"]), (
                f"misaligned weights moved q/k off the fast path: {shifted[0]['kernel']}")
        else:
            assert _template(aligned[0]["kernel"]) != _template(shifted[0]["kernel"]), (
                f"misaligned {which} still ran {shifted[0]['kernel']}")


def test_earlier_error_is_not_this_launchs(device, libs):
    """A CUDA error left pending by earlier work on the thread: the launch still reports success
    (cudaLaunchKernel's own status) and the earlier error stays for its owner to read."""
    lib = ctypes.CDLL(str(kernels.simt_library_path()))
    lib.qkrope_simt_peek_error.restype = ctypes.c_int32
    lib.qkrope_simt_set_pending_error.argtypes = [ctypes.c_int32]
    cuda_error_invalid_value = 1
    lib.qkrope_simt_set_pending_error(cuda_error_invalid_value)
    try:
        inputs = make_inputs(torch.bfloat16, 128, 128, batch=1, seq=3, heads=2, seed=4)
        outs = kernels.simt_qk_norm_rope(*inputs)  # raises KernelStatusError on a non-zero status
        assert_bit_exact(outs, kernels.host_qk_norm_rope(*inputs))
        assert lib.qkrope_simt_peek_error() == cuda_error_invalid_value
    finally:
        kernels.simt_reset()
    assert lib.qkrope_simt_peek_error() == 0


def test_qwen_image_heads(device):
    """Qwen-Image's head layout (24 x 128), bf16, a few tokens, both rounding modes."""
    for rounding in (0, 1):
        run_checked(torch.bfloat16, 128, 128, rounding=rounding, batch=1, seq=5, heads=24,
                    grid=True, seed=11)
        inputs = make_inputs(torch.bfloat16, 128, 128, batch=1, seq=5, heads=24, seed=12)
        outs = kernels.simt_qk_norm_rope(*inputs, rounding=rounding)
        check_against_fp32(outs, inputs, torch.bfloat16, True)


def test_seeded_schedules_agree(device):
    """A seeded random order of fibers and blocks gives the same results as round-robin."""
    cases = [(torch.bfloat16, 128, 128, False), (torch.float16, 96, 32, False),
             (torch.float32, 256, 128, True)]
    for dtype, d, r, inter in cases:
        inputs = make_inputs(dtype, d, r, batch=2, seq=3, heads=3, seed=5)
        kernels.simt_configure(seed=0)
        ref = kernels.simt_qk_norm_rope(*inputs, interleaved=inter)
        for seed in (1, 2):
            kernels.simt_configure(seed=seed)
            outs = kernels.simt_qk_norm_rope(*inputs, interleaved=inter)
            assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(outs, ref)), (dtype, d, seed)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_nan_rows_bit_exact(device, dtype):
    """A NaN in a row makes the row NaN: the emulated device conversions (0x7FFF for NaN) differ
    from torch's NaN (0x7E00 / 0x7FC0), so the kernel's canonicalisation must be what makes the
    raw bits agree with the CPU build."""
    for d, inter in ((128, True), (128, False), (96, True)):
        q, k, qw, kw, cache = make_inputs(dtype, d, d, batch=1, seq=3, heads=2, grid=True)
        q[0, 1, 0, 5] = float("nan")
        k[0, 2, 1, 0] = float("nan")
        expected = kernels.host_qk_norm_rope(q, k, qw, kw, cache, interleaved=inter)
        outs = kernels.simt_qk_norm_rope(q, k, qw, kw, cache, interleaved=inter)
        for o, e in zip(outs, expected):
            assert bool(o.isnan().any())
            assert torch.equal(_bits(o), _bits(e)), (
                f"NaN bit patterns differ: emulated {sorted(set(_bits(o)[o.isnan()].tolist()))}, "
                f"CPU build {sorted(set(_bits(e)[e.isnan()].tolist()))}")


# Special values at (token, head, element) of q, and the row they poison: a negative NaN (what
# x86 produces for inf x 0), NaNs with payloads, +-inf (the row's inv becomes 0, inf x 0 = NaN
# for the inf element and 0 x finite = 0 for the others), and an inf weight (NaN where it
# multiplies 0, inf elsewhere).
SPECIALS = {
    "negative NaN": 0xFFC00000, "NaN payload": 0x7F800001, "negative NaN payload": 0xFFFFFFFF,
    "+inf": 0x7F800000, "-inf": 0xFF800000,
}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("special", sorted(SPECIALS))
def test_special_values_same_bits_as_the_cpu_build(device, dtype, special):
    """NaNs of either sign and any payload, infinities: the emulated kernel and the CPU build give
    the same bits (one NaN per dtype: bf16 0x7FC0, fp16 0x7E00), and the NaN positions are the
    PyTorch reference's (torch's casts may keep a NaN's sign or payload, so its bits may differ)."""
    from qkrope.export.reference import qk_norm_rope_reference

    value = torch.tensor([SPECIALS[special] - (1 << 32) if SPECIALS[special] >= 1 << 31
                          else SPECIALS[special]], dtype=torch.int32).view(torch.float32)
    for d, inter in ((128, True), (128, False), (96, True)):
        q, k, qw, kw, cache = make_inputs(torch.float32, d, d, batch=1, seq=3, heads=2, grid=False,
                                          seed=7)
        q[0, 1, 0, 5] = value[0]
        kw = kw.clone()
        kw[3] = float("inf")
        q, k, qw, kw = (t.to(dtype) for t in (q, k, qw, kw))
        expected = kernels.host_qk_norm_rope(q, k, qw, kw, cache, interleaved=inter)
        outs = kernels.simt_qk_norm_rope(q, k, qw, kw, cache, interleaved=inter)
        ref = qk_norm_rope_reference(q, k, qw, kw, cache, interleaved=inter)
        canonical = {torch.float16: 0x7E00, torch.bfloat16: 0x7FC0}[dtype]
        for o, e, r in zip(outs, expected, ref):
            assert torch.equal(_bits(o), _bits(e)), (
                f"{special}: bits differ: emulated {sorted(set(_bits(o)[o.isnan()].tolist()))}, "
                f"CPU build {sorted(set(_bits(e)[e.isnan()].tolist()))}")
            assert torch.equal(o.isnan(), r.isnan()), f"{special}: NaN positions differ from torch"
            assert set((_bits(o)[o.isnan()] & 0xFFFF).tolist()) <= {canonical}
            assert torch.equal(o.isinf(), r.isinf()) and torch.equal(o[o.isinf()], r[r.isinf()])


def test_bad_params_status_and_exports(libs):
    lib = kernels._simt_lib()
    args = [None] * 7 + [1, 2, 2, 64, 64, 2, 1e-6, 1, 0]
    assert lib.qkrope_launch(*args, 0, None) == 1   # kNULL_POINTER, nothing launched
    assert lib.qkrope_launch(*args, 7, None) == 5   # kBAD_DTYPE
    assert lib.qkrope_capi_version() == 1
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) not available to list the library's symbols")
    out = subprocess.run([nm, "-D", "--defined-only", str(kernels.simt_library_path())],
                         capture_output=True, text=True, check=True).stdout
    names = sorted(line.split()[-1] for line in out.splitlines() if line.strip())
    assert {"qkrope_launch", "qkrope_status_string", "qkrope_capi_version"} <= set(names)
    extra = [n for n in names if not n.startswith("qkrope_")]
    assert not extra, f"unexpected exported symbols: {extra[:10]}"


def test_missing_library_message(monkeypatch, tmp_path):
    monkeypatch.setenv(kernels.SIMT_LIB_ENV, str(tmp_path / "nope.so"))
    q, k, qw, kw, cache = make_inputs(torch.float32, 64, 64)
    with pytest.raises(kernels.KernelLibraryError, match="qkrope_kernels_simt"):
        kernels.simt_qk_norm_rope(q, k, qw, kw, cache)


# ---- the emulator itself ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def selftest(libs):
    lib = ctypes.CDLL(str(libs / "libqkrope_simt_selftest.so"))
    i32p = ctypes.POINTER(ctypes.c_int32)
    f32p = ctypes.POINTER(ctypes.c_float)
    lib.simt_selftest_shfl.argtypes = [ctypes.c_int32, ctypes.c_int32, i32p, ctypes.c_int32, i32p, f32p]
    lib.simt_selftest_misuse.argtypes = [ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, i32p]
    lib.simt_selftest_skip.argtypes = [ctypes.c_int32, i32p]
    lib.simt_selftest_syncthreads.argtypes = [ctypes.c_int32, ctypes.c_int32, i32p]
    lib.simt_selftest_shared_isolation.argtypes = [ctypes.c_int32, ctypes.c_int32, i32p]
    lib.simt_selftest_vote.argtypes = [i32p]
    lib.simt_selftest_exit_early.argtypes = [i32p]
    lib.qkrope_simt_set_strict_exit.argtypes = [ctypes.c_int32]
    lib.simt_selftest_convert.argtypes = [f32p, ctypes.c_void_p, ctypes.c_void_p, f32p, f32p, ctypes.c_int32]
    lib.simt_selftest_frsqrt.argtypes = [f32p, f32p, ctypes.c_int32]
    lib.qkrope_simt_last_error.restype = ctypes.c_char_p
    lib.qkrope_simt_configure.argtypes = [ctypes.c_int32, ctypes.c_int32, ctypes.c_int64]
    return lib


def _ptr(t, kind=ctypes.c_int32):
    return ctypes.cast(t.data_ptr(), ctypes.POINTER(kind))


def _shfl_model(op, width, args, nthreads):
    """The CUDA programming guide's rules: lanes split into segments of `width`; idx reads
    srcLane mod width of the own segment; up/down read delta lanes away and keep the own value
    outside the segment; xor reads lane ^ laneMask, own value when that lies in a later segment."""
    out = []
    for tid in range(nthreads):
        lane, warp = tid % 32, tid // 32
        seg = lane // width * width
        a = args[tid]
        if op == 0:
            src = seg + a % width
        elif op == 1:
            src = lane - a if lane - a >= seg else lane
        elif op == 2:
            src = lane + a if lane + a < seg + width else lane
        else:
            src = lane ^ a if (lane ^ a) < seg + width else lane
        out.append(1000 * warp + src)
    return out


def test_shuffle_semantics_every_width(selftest, device):
    g = torch.Generator().manual_seed(1)
    n = 64
    out = torch.zeros(n, dtype=torch.int32)
    fout = torch.zeros(n, dtype=torch.float32)
    for width in (1, 2, 4, 8, 16, 32):
        for op in range(4):
            patterns = [torch.full((n,), v, dtype=torch.int32) for v in (0, 1, width // 2, width - 1)]
            lo, hi = ((-40, 70) if op == 0 else (0, 32))
            patterns.append(torch.randint(lo, hi, (n,), generator=g, dtype=torch.int32))
            for args in patterns:
                rc = selftest.simt_selftest_shfl(op, width, _ptr(args), n, _ptr(out),
                                                 _ptr(fout, ctypes.c_float))
                assert rc == 0, selftest.qkrope_simt_last_error().decode()
                model = _shfl_model(op, width, args.tolist(), n)
                assert out.tolist() == model, (op, width, args.tolist())
                assert fout.tolist() == [m + 0.5 for m in model]
    for width in (w for w in range(1, 33) if w & (w - 1)):  # not a power of two: reported
        rc = selftest.simt_selftest_shfl(3, width, _ptr(torch.ones(32, dtype=torch.int32)), 32,
                                         _ptr(out), _ptr(fout, ctypes.c_float))
        assert rc != 0 and "power of two" in selftest.qkrope_simt_last_error().decode()


@pytest.mark.parametrize("mode, nthreads, expect", [
    (0, 32, r"mismatched collective|deadlock"),
    (1, 32, r"not in its own mask"),
    (2, 32, r"mismatched collective.*width"),
    (3, 32, r"mismatched collective: __shfl_down_sync.*__shfl_xor_sync"),
    (4, 32, r"mismatched collective"),
    (5, 64, r"deadlock.*__syncthreads"),
    (6, 32, r"deadlock"),
    (8, 32, r"not in the mask"),
    (9, 32, r"__ldcs.*misaligned"),
])
def test_misuse_is_reported_not_hung(selftest, device, mode, nthreads, expect):
    out = torch.zeros(nthreads, dtype=torch.int32)
    t0 = time.monotonic()
    rc = selftest.simt_selftest_misuse(mode, 0, nthreads, _ptr(out))
    msg = selftest.qkrope_simt_last_error().decode()
    assert rc == (716 if mode == 9 else 719), (rc, msg)
    assert re.search(expect, msg), msg
    assert "misuseKernel" in msg and "block (0,0,0)" in msg and "simt_selftest.cpp:" in msg, msg
    # The emulator detects the misuse from its fibers' states, not by a timeout, so it returns
    # in milliseconds; this only tells "reported" from "hung" (a generous guard, not a timing).
    assert time.monotonic() - t0 < 120


@pytest.mark.parametrize("seed", [0, 3])
def test_lane_skipping_a_shuffle_is_a_reported_deadlock(selftest, device, seed):
    selftest.qkrope_simt_configure(-1, -1, seed)
    for lane in (0, 17, 31):
        rc = selftest.simt_selftest_skip(lane, _ptr(torch.zeros(32, dtype=torch.int32)))
        msg = selftest.qkrope_simt_last_error().decode()
        assert rc == 719 and "__shfl_xor_sync" in msg, msg
        assert f"reads lane {lane}, which exited without taking part" in msg, msg
    selftest.qkrope_simt_set_strict_exit(1)   # strict: the exit itself is the error
    rc = selftest.simt_selftest_skip(5, _ptr(torch.zeros(32, dtype=torch.int32)))
    msg = selftest.qkrope_simt_last_error().decode()
    selftest.qkrope_simt_set_strict_exit(0)
    assert rc == 719 and "deadlock (strict)" in msg and "lane 5" in msg, msg
    selftest.qkrope_simt_configure(-1, -1, 0)
    out = torch.zeros(32, dtype=torch.int32)
    assert selftest.simt_selftest_skip(-1, _ptr(out)) == 0   # nobody skips: fine
    assert out.tolist() == [lane ^ 1 for lane in range(32)]


def test_exited_lanes_need_not_take_part(selftest, device):
    """CUDA: only the non-exited lanes named in a mask must execute the collective."""
    out = torch.full((32,), -1, dtype=torch.int32)
    assert selftest.simt_selftest_exit_early(_ptr(out)) == 0, selftest.qkrope_simt_last_error()
    assert out.tolist() == [(lane ^ 1) + 100 for lane in range(16)] + [-1] * 16


@pytest.mark.parametrize("seed", [0, 9])
def test_syncthreads_is_a_block_barrier(selftest, device, seed):
    selftest.qkrope_simt_configure(-1, -1, seed)
    blocks, n = 3, 96
    out = torch.zeros(blocks * n, dtype=torch.int32)
    assert selftest.simt_selftest_syncthreads(blocks, n, _ptr(out)) == 0
    expected = [7 * ((t + 1) % n) + 1000 * b for b in range(blocks) for t in range(n)]
    assert out.tolist() == expected
    selftest.qkrope_simt_configure(-1, -1, 0)


def test_shared_memory_is_per_block_and_per_concurrent_launch(selftest, device):
    outs = [torch.zeros(256, dtype=torch.int32) for _ in range(2)]
    rcs = [None, None]

    def go(i):
        rcs[i] = selftest.simt_selftest_shared_isolation(100000 * (i + 1), 50, _ptr(outs[i]))

    threads = [threading.Thread(target=go, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert rcs == [0, 0]
    for o in outs:
        assert o.tolist() == [(t + 1) % 256 for t in range(256)]


def test_vote_match_reduce(selftest, device):
    out = torch.zeros(64 * 8, dtype=torch.int32)
    assert selftest.simt_selftest_vote(_ptr(out)) == 0
    rows = out.view(64, 8).tolist()
    ballot = sum(1 << lane for lane in range(32) if lane % 3 == 0)
    for tid, r in enumerate(rows):
        lane = tid % 32
        match = sum(1 << j for j in range(32) if j % 4 == lane % 4)
        assert r[0] & 0xFFFFFFFF == ballot and r[1] == 1 and r[2] == 0
        assert r[3] & 0xFFFFFFFF == match and r[4] & 0xFFFFFFFF == 0xFFFFFFFF and r[5] == 1
        assert r[6] == sum(range(32)) and r[7] == 3


def test_device_conversions(selftest):
    """bf16/fp16 from fp32: round to nearest even (ties included), subnormals, overflow to inf,
    and NaN -> 0x7FFF (what cvt.rn.{bf16,f16}.f32 give) -- not torch's 0x7FC0 / 0x7E00."""
    vals = [0.0, -0.0, 1.0, -2.5, 65504.0, 65519.99, 65520.0, 1e-8, 2.0 ** -24, 2.0 ** -25,
            3 * 2.0 ** -26, 2.0 ** -14 * 0.999, 1e38, 3.4e38, float("inf"), -float("inf"),
            1.00390625, 1.01171875, 1.0009765625, 1.0029296875, 1.5 * 2.0 ** -133]
    x = torch.tensor(vals, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    x = torch.cat([x, torch.randn(2000, generator=g) * 10.0 ** torch.randint(-8, 8, (2000,), generator=g)])
    nan_bits = torch.tensor([0x7FC00000, 0xFFC00000 - (1 << 32), 0x7F800001, 0x7FFFFFFF],
                            dtype=torch.int32).view(torch.float32)
    x = torch.cat([x, nan_bits])
    n = x.numel()
    bf, hf = torch.zeros(n, dtype=torch.int16), torch.zeros(n, dtype=torch.int16)
    hb, bb = torch.zeros(n), torch.zeros(n)
    selftest.simt_selftest_convert(_ptr(x, ctypes.c_float), bf.data_ptr(), hf.data_ptr(),
                                   _ptr(hb, ctypes.c_float), _ptr(bb, ctypes.c_float), n)
    finite = ~x.isnan()
    assert torch.equal(bf[finite], x[finite].to(torch.bfloat16).view(torch.int16))
    assert torch.equal(hf[finite], x[finite].to(torch.float16).view(torch.int16))
    assert (bf[~finite] == 0x7FFF).all() and (hf[~finite] == 0x7FFF).all()
    assert torch.equal(hb[finite], hf[finite].view(torch.float16).float())
    assert torch.equal(bb[finite], bf[finite].view(torch.bfloat16).float())
    # the emulated device's NaN differs from torch's: what the kernel must canonicalise
    assert int(torch.tensor(float("nan")).to(torch.bfloat16).view(torch.int16)) == 0x7FC0
    assert int(torch.tensor(float("nan")).to(torch.float16).view(torch.int16)) == 0x7E00


def test_frsqrt_correctly_rounded(selftest):
    g = torch.Generator().manual_seed(2)
    x = torch.cat([torch.rand(5000, generator=g) * 10.0 ** torch.randint(-30, 30, (5000,), generator=g),
                   torch.tensor([1.0, 4.0, 2.0, 1e-45, 3.4e38])]).float()
    out = torch.zeros_like(x)
    selftest.simt_selftest_frsqrt(_ptr(x, ctypes.c_float), _ptr(out, ctypes.c_float), x.numel())
    exact = 1.0 / x.double().sqrt()  # rounding this once to fp32 is correct except at near-ties
    ref = exact.float()
    assert torch.equal(out, ref)


# ---- mutants: kernel bugs the emulated checks catch and the CPU build cannot see ---------------------------
# (description, file, regex, replacement, check): the regexes target qknorm_rope.cu (or the
# headers it includes); a mutant whose regex no longer matches is skipped with a message.
MUTANTS = [
    ("xor reduction over half the row group (shuffle width kLanes / 2)", "qknorm_rope.cu",
     r"__shfl_xor_sync\(kFullMask, sumSq\[u\], offset, kLanes\)",
     "__shfl_xor_sync(kFullMask, sumSq[u], offset, kLanes / 2)", "fast"),
    ("NeoX partner shuffle width 32 instead of the row group (kLanes)", "qknorm_rope.cu",
     r"__shfl_sync\(kFullMask, y\[i\], partner, kLanes\)",
     "__shfl_sync(kFullMask, y[i], partner, 32)", "neox"),
    ("general path: __syncwarp before the shared-memory pair exchange dropped", "qknorm_rope.cu",
     r"(\n\s*)__syncwarp\(\);(?!\s*//)", r"\1/* __syncwarp() removed */", "general"),
    ("lanes past the rotary part skip the NeoX shuffle (a lane skipping a shuffle)", "qknorm_rope.cu",
     r"float const other = __shfl_sync\(kFullMask, y\[i\], partner, kLanes\);",
     "float const other = (lane * kVec >= rot) ? y[i] : __shfl_sync(kFullMask, y[i], partner, kLanes);",
     "neox_partial"),
    ("prefetch ring: the loads two tokens ahead overwrite a buffer not yet computed", "qknorm_rope.cu",
     r"token\(rawB, rawA\);", "token(rawB, rawC);", "ring"),
    ("dropped row: the general path's token loop stops one token early", "qknorm_rope.cu",
     r"for \(; t < a\.numTokens; t \+= a\.tokenStep\)",
     "for (; t < a.numTokens - 1; t += a.tokenStep)", "general"),
]

MUTANT_CASES = {
    "fast": [dict(dtype=torch.bfloat16, head_dim=128, rotary_dim=128, heads=3, seq=3),
             dict(dtype=torch.float32, head_dim=64, rotary_dim=64, heads=3, seq=3)],
    "neox": [dict(dtype=torch.bfloat16, head_dim=128, rotary_dim=128, heads=3, seq=3,
                  interleaved=False),
             dict(dtype=torch.float16, head_dim=64, rotary_dim=32, heads=3, seq=3,
                  interleaved=False)],
    # enough tokens that every row group walks several: a lane that skipped the shuffle of one
    # token arrives at the next token's reduction while its group still waits in the shuffle
    "neox_partial": [dict(dtype=torch.float16, head_dim=128, rotary_dim=64, heads=2, seq=64,
                          interleaved=False)],
    # every row group walks more than three tokens, so the ring turns over at least once
    "ring": [dict(dtype=torch.bfloat16, head_dim=128, rotary_dim=128, heads=2, seq=160)],
    "general": [dict(dtype=torch.bfloat16, head_dim=96, rotary_dim=96, heads=3, seq=3,
                     interleaved=False),
                dict(dtype=torch.float32, head_dim=48, rotary_dim=48, heads=2, seq=3)],
}


def _compile_mutant(tmp: Path, src_name: str, text: str) -> Path:
    """The mutated source compiled on its own (-O0: the fastest compile), linked with the build's
    other objects."""
    cxx, _ = _tools()
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / src_name).write_text(text)
    main = tmp / "qknorm_rope.cu"
    if src_name != "qknorm_rope.cu":
        shutil.copy(KERNEL_SRC / "qknorm_rope.cu", main)
    objs = []
    for pat in ("qknorm_rope_capi.cu.o", "qknorm_rope_check.cpp.o", "simt.cpp.o"):
        hits = [p for p in BUILD_DIR.rglob(pat) if "qkrope_kernels_simt" in str(p)
                or "qkrope_simt_runtime" in str(p)]
        assert hits, f"{pat} not found under {BUILD_DIR}"
        objs.append(str(hits[0]))
    obj = tmp / "mutant.o"
    flags = ["-std=c++17", "-O0", "-fPIC", "-fvisibility=hidden", "-fvisibility-inlines-hidden",
             "-D__CUDACC__", "-D__CUDA_ARCH__=900", "-DQKROPE_SIMT=1", "-ffp-contract=off",
             "-fno-fast-math", "-fno-strict-aliasing", "-w",
             f"-I{tmp}", f"-I{SIMT_SRC}", f"-I{KERNEL_SRC}"]
    res = subprocess.run([cxx, *flags, "-x", "c++", "-c", str(main), "-o", str(obj)],
                         capture_output=True, text=True)
    assert res.returncode == 0, f"mutant does not compile:\n{res.stderr[-3000:]}"
    lib = tmp / "libqkrope_kernels_simt.so"
    res = subprocess.run([cxx, "-shared", "-o", str(lib), str(obj), *objs, "-ldl"],
                         capture_output=True, text=True)
    assert res.returncode == 0, f"mutant does not link:\n{res.stderr[-3000:]}"
    return lib


def _emulated_checks(case_key) -> str | None:
    """The emulated checks on the mutant's cases: None if all pass, else the first failure."""
    for case in MUTANT_CASES[case_key]:
        c = dict(case)
        try:
            run_checked(c.pop("dtype"), c.pop("head_dim"), c.pop("rotary_dim"), batch=1,
                        grid=True, seed=4, **c)
        except (AssertionError, kernels.KernelStatusError) as exc:
            return f"{type(exc).__name__}: {str(exc).splitlines()[0][:400]}"
    return None


def _host_checks(case_key):
    """What the CPU-build tests check (against the Python reference): unaffected by the .cu."""
    from _kernel_cases import reference
    for case in MUTANT_CASES[case_key]:
        c = dict(case)
        inputs = make_inputs(c["dtype"], c["head_dim"], c["rotary_dim"], batch=1, seq=c["seq"],
                             heads=c["heads"], grid=True, seed=4)
        kw = dict(interleaved=c.get("interleaved", True), rounding=0)
        assert_bit_exact(kernels.host_qk_norm_rope(*inputs, **kw), reference(*inputs, **kw))


@pytest.fixture(scope="module")
def mutant_libs(libs, tmp_path_factory):
    """{description: library path | None (regex no longer matches) | Exception}, compiled two at
    a time (the compile dominates this part's time)."""
    from concurrent.futures import ThreadPoolExecutor
    root = tmp_path_factory.mktemp("mutants")
    jobs = {}
    with ThreadPoolExecutor(max_workers=2) as pool:
        for i, (desc, src_name, pattern, repl, _) in enumerate(MUTANTS):
            mutated, n = re.subn(pattern, repl, (KERNEL_SRC / src_name).read_text(), count=1)
            jobs[desc] = (pool.submit(_compile_mutant, root / f"m{i}", src_name, mutated)
                          if n else None)
        out = {}
        for desc, job in jobs.items():
            try:
                out[desc] = job.result() if job is not None else None
            except Exception as exc:  # reported by the mutant's test
                out[desc] = exc
    return out


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m[0][:40])
def test_mutant_caught_by_emulation_not_by_host_build(mutant_libs, device, monkeypatch, mutant):
    desc, src_name, _, _, case_key = mutant
    lib = mutant_libs[desc]
    if lib is None:
        pytest.skip(f"mutant '{desc}': its regex no longer matches {src_name} (update MUTANTS)")
    if isinstance(lib, Exception):
        raise lib
    assert _emulated_checks(case_key) is None, "the unmutated kernel must pass these checks"
    monkeypatch.setenv(kernels.SIMT_LIB_ENV, str(lib))
    kernels.simt_configure(**DEFAULT_DEVICE, dry_run=False)
    failure = _emulated_checks(case_key)
    _host_checks(case_key)  # the CPU build never compiles the .cu: it cannot see the mutant
    print(f"\nmutant: {desc}\n  caught: {failure}")
    assert failure is not None, f"mutant '{desc}' survived the emulated checks"
