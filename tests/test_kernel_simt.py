"""The CUDA kernel and launcher (plugins/kernel/qknorm_rope.cu, unchanged) run on the CPU through
the SIMT emulation of plugins/simt: every CUDA thread a fiber, warp shuffles and barriers real
barriers between them (a lane that skips a shuffle is a reported deadlock, a wrong partner lane a
wrong result). Needs only g++ and cmake; the libraries are built by tests/_simt.py.

- every kernel instance compiled into the library is launched: the launcher's choice for a grid of
  problem shapes is probed with dry-run launches (recorded, not run), and for every instance in the
  library's symbol table the smallest problem that selects it is run for real;
- each run is compared bit for bit with the CPU build (libqkrope_kernel_host.so, the same maths in
  the kernel's summation order), with the outputs prefilled with a sentinel no conversion produces
  (none may survive) inside guard bands that must stay untouched;
- the small-problem split, grid-stride loops (a 1-SM device), in place, misaligned pointers, the
  Qwen-Image head layout, seeded scheduling orders, NaN rows, the library's C ABI and exports.

The emulator itself: tests/test_kernel_simt_emulator.py; kernel mutants the emulated checks catch:
tests/test_kernel_simt_mutants.py.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import pytest
import torch

from _kernel_cases import (LAUNCH_LAYOUTS, assert_bit_exact, check_against_fp32, layout_id,
                           make_inputs)
from _native import require_native_tools
from _simt import DEVICE_MODELS, _bits, _instance, _template, run_checked, use_device
from _simt import device, libs  # noqa: F401 (pytest fixtures)
from qkrope import contract
from qkrope.runtime import kernels


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
                        for rnd in contract.ROUNDING_MODES:
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


def _run_instances(found, dtype, grid, **extra):
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
                                   **p, **extra)
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


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_every_instance_fp32_weights_bit_exact(plan, device, dtype):
    """float32 norm weights under 16-bit activations (FLUX.3 keeps norm_q/norm_k in fp32):
    every instance of the dtype, random inputs and weights no 16-bit type holds, bit for bit with
    the CPU build, which reads the weights as float32 by its own code (qknorm_rope_host.cpp)."""
    found, _ = plan
    ran = _run_instances(found, dtype, grid=False, weights_fp32=True)
    assert ran, "no instance of this dtype was reached"


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
    for rounding in contract.ROUNDING_MODES:
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
        for rounding in contract.ROUNDING_MODES:
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
    lib.simt_peek_error.restype = ctypes.c_int32
    lib.simt_set_pending_error.argtypes = [ctypes.c_int32]
    cuda_error_invalid_value = 1
    lib.simt_set_pending_error(cuda_error_invalid_value)
    try:
        inputs = make_inputs(torch.bfloat16, 128, 128, batch=1, seq=3, heads=2, seed=4)
        outs = kernels.simt_qk_norm_rope(*inputs)  # raises KernelStatusError on a non-zero status
        assert_bit_exact(outs, kernels.host_qk_norm_rope(*inputs))
        assert lib.simt_peek_error() == cuda_error_invalid_value
    finally:
        kernels.simt_reset()
    assert lib.simt_peek_error() == 0


def test_qwen_image_heads(device):
    """Qwen-Image's head layout (24 x 128), bf16, a few tokens, both rounding modes."""
    for rounding in (0, 1):
        run_checked(torch.bfloat16, 128, 128, rounding=rounding, batch=1, seq=5, heads=24,
                    grid=True, seed=11)
        inputs = make_inputs(torch.bfloat16, 128, 128, batch=1, seq=5, heads=24, seed=12)
        outs = kernels.simt_qk_norm_rope(*inputs, rounding=rounding)
        check_against_fp32(outs, inputs, torch.bfloat16, True)


@pytest.mark.parametrize("layout", LAUNCH_LAYOUTS, ids=layout_id)
def test_family_launch_layouts(device, layout):
    """Every head layout a family launches (its record's launches: heads x head_dim, pairing,
    rotated width), bf16 and fp16, in each rounding mode it is planned with, a few tokens: bit
    for bit with the CPU build."""
    heads, d, rot, inter, roundings = layout
    for dtype in (torch.bfloat16, torch.float16):
        for rounding in roundings:
            run_checked(dtype, d, rot, rounding=rounding, batch=1, seq=3, heads=heads,
                        interleaved=inter, grid=False, seed=heads + rounding)


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
    assert lib.qkrope_capi_version() == 3
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) not available to list the library's symbols")
    out = subprocess.run([nm, "-D", "--defined-only", str(kernels.simt_library_path())],
                         capture_output=True, text=True, check=True).stdout
    names = sorted(line.split()[-1] for line in out.splitlines() if line.strip())
    assert {"qkrope_launch", "qkrope_status_string", "qkrope_capi_version"} <= set(names)
    # the kernel's C ABI (qkrope_*), the emulator's C API (simt_*, and its former names
    # qkrope_simt_*: tests/test_kernel_simt_emulator.py checks those sets exactly)
    extra = [n for n in names if not n.startswith(("qkrope_", "simt_"))]
    assert not extra, f"unexpected exported symbols: {extra[:10]}"


def test_missing_library_message(monkeypatch, tmp_path):
    monkeypatch.setenv(kernels.SIMT_LIB_ENV, str(tmp_path / "nope.so"))
    q, k, qw, kw, cache = make_inputs(torch.float32, 64, 64)
    with pytest.raises(kernels.KernelLibraryError, match="qkrope_kernels_simt"):
        kernels.simt_qk_norm_rope(q, k, qw, kw, cache)


def test_library_without_the_simt_names_is_rejected(monkeypatch, tmp_path):
    """A library built before the emulator's functions were named simt_* (it has the kernel's C
    ABI and only the former qkrope_simt_* names): one clear error with the rebuild command."""
    cxx, _ = require_native_tools("a stand-in for a stale emulation library")
    src = tmp_path / "stale.cpp"
    src.write_text('extern "C" int qkrope_launch() { return 0; }\n'
                   'extern "C" int qkrope_launch_scoped() { return 0; }\n'
                   'extern "C" int qkrope_launch_v3() { return 0; }\n'
                   'extern "C" char const* qkrope_status_string(int) { return "ok"; }\n'
                   'extern "C" int qkrope_simt_configure(int, int, long long) { return 0; }\n')
    lib = tmp_path / "libstale_simt.so"
    subprocess.run([cxx, "-shared", "-fPIC", "-o", str(lib), str(src)], check=True,
                   capture_output=True)
    monkeypatch.setenv(kernels.SIMT_LIB_ENV, str(lib))
    with pytest.raises(kernels.KernelLibraryError,
                       match=r"predates the emulator's simt_\* control functions.*Rebuild it with"):
        kernels.simt_reset()
