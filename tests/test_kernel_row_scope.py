"""norm_scope 1 ("row": one RMSNorm over a token's heads x head_dim values, weight [heads *
head_dim], then the per-head RoPE) in the kernel: the CPU build against the reference, the CUDA
source under the SIMT emulation bit for bit against the CPU build (every row-scope instance the
launcher picks), and a kernel mutant with a partial cross-warp reduction that the emulated check
catches. Sizes are small: the emulation runs every CUDA thread as a fiber.

The summation order (plugins/kernel/qknorm_rope_math.h rowSumSquares): each head's sum in the
per-head order of the path, head h added into lane h % 32, a butterfly over the 32 lanes; it does
not depend on the instance, so the CPU build matches every instance bit for bit. Against the
reference (torch's own order over heads x head_dim values) the sums differ by a few fp32 ulps,
relative ~1e-6 at most for these rows, far below a bf16/fp16 step, so the order policy of
tests/_kernel_cases.py holds unchanged (<= 1 / 2 / 1 + sqrt(2) steps by rounding mode); grid
inputs (exact sums while heads x head_dim x 127^2 < 2^24 x 16^2 / 16^2, i.e. rows up to 1536
values here) are bit-exact.
"""

from __future__ import annotations

import os

import pytest
import torch

from _kernel_cases import (assert_bit_exact, assert_within_order_policy, check_against_fp32,
                           make_inputs, reference, row_weights)
from _native import build_simt, require_native_tools  # noqa: F401
from qkrope import contract
from qkrope.errors import InputError
from qkrope.runtime import kernels

ROW = 1
# (head_dim, rotary_dim, heads): fast path (one and two chunks per thread, partial rotary) and the
# general path (head_dim 96, 48)
HOST_CASES = ((128, 128, 5), (64, 32, 3), (256, 128, 3), (96, 96, 3), (48, 32, 4))


@pytest.fixture(scope="module")
def host_lib():
    explicit = os.environ.get(kernels.HOST_LIB_ENV)
    if explicit:
        yield explicit
        return
    d = build_simt(("qkrope_kernel_host",))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(kernels.HOST_LIB_ENV, str(d / kernels.HOST_LIB_NAME))
        yield d


def _host(inputs, **kw):
    return kernels.host_qk_norm_rope(*inputs, norm_scope=ROW, **kw)


@pytest.mark.parametrize("rounding", contract.ROUNDING_MODES)
@pytest.mark.parametrize("interleaved", (True, False), ids=("gptj", "neox"))
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16, torch.bfloat16),
                         ids=("fp32", "fp16", "bf16"))
def test_host_matches_reference(host_lib, dtype, interleaved, rounding):
    kw = dict(interleaved=interleaved, rounding=rounding)
    for d, r, heads in HOST_CASES:
        grid = row_weights(make_inputs(dtype, d, r, heads=heads, grid=True, seed=d + heads))
        assert_bit_exact(_host(grid, **kw), reference(*grid, norm_scope=ROW, **kw))
        inputs = row_weights(make_inputs(dtype, d, r, heads=heads, seed=d + r))
        outs = _host(inputs, **kw)
        check_against_fp32(outs, inputs, dtype, interleaved, norm_scope=ROW)
        if dtype != torch.float32:
            assert_within_order_policy(outs, reference(*inputs, norm_scope=ROW, **kw), dtype,
                                       rounding)


@pytest.mark.parametrize("d, r", ((128, 128), (96, 64)))
def test_one_head_is_the_per_head_op(host_lib, d, r):
    """With one head the row is the head: norm_scope 1 and 0 agree bit for bit (the cross-head
    sum adds exact zeros), on random rows."""
    inputs = make_inputs(torch.bfloat16, d, r, heads=1, seed=4)
    for rounding in contract.ROUNDING_MODES:
        a = kernels.host_qk_norm_rope(*inputs, rounding=rounding)
        b = kernels.host_qk_norm_rope(*inputs, rounding=rounding, norm_scope=ROW)
        assert torch.equal(a[0].view(torch.int16), b[0].view(torch.int16))
        assert torch.equal(a[1].view(torch.int16), b[1].view(torch.int16))


def test_scope_changes_the_result(host_lib):
    """The scope is honoured: with several heads of different scales the two scopes differ."""
    q, k, _, _, cache = make_inputs(torch.float32, 64, 64, heads=3, seed=2)
    q = q * torch.tensor([1.0, 4.0, 0.25]).view(1, 1, 3, 1)
    w = torch.ones(64)
    head = kernels.host_qk_norm_rope(q, k, w, w, cache)
    row = kernels.host_qk_norm_rope(q, k, w.repeat(3), w.repeat(3), cache, norm_scope=ROW)
    assert not torch.allclose(head[0], row[0])


def test_refusals(host_lib):
    inputs = make_inputs(torch.float16, 64, 64, heads=2)
    with pytest.raises(InputError, match=r"q_weight must be \[128\].*norm_scope 1"):
        kernels.host_qk_norm_rope(*inputs, norm_scope=ROW)          # [head_dim] weights
    with pytest.raises(InputError, match="norm_scope must be one of"):
        kernels.host_qk_norm_rope(*inputs, norm_scope=2)
    # the C ABI's own check (kBAD_ATTRIBUTE), past the Python one
    lib = kernels._load(kernels.HOST_LIB_ENV, kernels.HOST_LIB_NAME, "", "qkrope_host_run_scoped",
                        "qkrope_host_status_string", cuda=False)
    q, k, qw, kw, cache = inputs
    out = torch.empty_like(q), torch.empty_like(k)
    status = lib.qkrope_host_run_scoped(q.data_ptr(), k.data_ptr(), qw.data_ptr(), kw.data_ptr(),
                                        cache.data_ptr(), out[0].data_ptr(), out[1].data_ptr(),
                                        2, 6, 2, 64, 64, 9, 1e-6, 1, 0, 2, 1)
    assert status == 6 and b"norm_scope 0 or 1" in lib.qkrope_host_status_string(status)


# ---- the CUDA source under the SIMT emulation ------------------------------------------------------
from _simt import DEVICE_MODELS, _instance, _template, run_checked, use_device  # noqa: E402
from _simt import device, libs  # noqa: E402,F401 (pytest fixtures)

ROW_TEMPLATES = ("qkNormRopeRowKernel", "qkNormRopeGeneralRowKernel")
PROBE_HEAD_ROT = ((64, 64), (64, 32), (128, 128), (128, 64), (256, 256), (256, 128), (96, 32))
PROBE_HEADS = (1, 3, 5, 8, 20, 32)
PROBE_TOKENS = ((1, 1), (1, 3), (2, 8))


@pytest.fixture(scope="module")
def row_plan(libs):
    """{instance: problem}: for every row-scope instance the dry-run probes reach, the smallest
    problem that selects it; and the row-scope instances compiled into the library."""
    found: dict[str, tuple] = {}
    try:
        for model in DEVICE_MODELS:
            use_device(model, dry_run=True)
            for dtype in (torch.float32, torch.float16, torch.bfloat16):
                for d, r in PROBE_HEAD_ROT:
                    for inter in (True, False):
                        for rnd in contract.ROUNDING_MODES:
                            for heads in PROBE_HEADS:
                                for batch, seq in PROBE_TOKENS:
                                    q = torch.empty(batch, seq, heads, d, dtype=dtype)
                                    w = torch.empty(heads * d, dtype=dtype)
                                    cache = torch.empty(seq, r)
                                    kernels.simt_reset()
                                    k = torch.empty_like(q)
                                    kernels.simt_qk_norm_rope(q, k, w, w, cache, interleaved=inter,
                                                              rounding=rnd, norm_scope=ROW,
                                                              out=(q, k))
                                    (rec,) = kernels.simt_last_launches()
                                    inst = _instance(rec["kernel"])
                                    cost = batch * seq * heads * d
                                    prob = dict(dtype=dtype, head_dim=d, rotary_dim=r,
                                                interleaved=inter, rounding=rnd, heads=heads,
                                                batch=batch, seq=seq, model=model)
                                    if inst not in found or cost < found[inst][0]:
                                        found[inst] = (cost, prob)
        # the general row kernel: pairs per lane 1, 2, 4, 8, pair-aligned or not (q one element off)
        use_device("default", dry_run=True)
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            for d in (48, 96, 200, 320):
                for misalign in (False, True):
                    base = torch.empty(3 * d + 1, dtype=dtype)
                    q = base[int(misalign):int(misalign) + 3 * d].view(1, 1, 3, d)
                    k = torch.empty_like(q)
                    w = torch.empty(3 * d, dtype=dtype)
                    kernels.simt_reset()
                    kernels.simt_qk_norm_rope(q, k, w, w, torch.empty(1, d), norm_scope=ROW,
                                              out=(q, k))
                    (rec,) = kernels.simt_last_launches()
                    inst = _instance(rec["kernel"])
                    prob = dict(dtype=dtype, head_dim=d, rotary_dim=d, interleaved=True,
                                rounding=0, heads=3, batch=1, seq=1, model="default",
                                misalign=("q",) if misalign else ())
                    found.setdefault(inst, (3 * d, prob))
    finally:
        use_device()
        kernels.simt_reset()
    compiled = set()
    for name in ROW_TEMPLATES:
        compiled |= {_instance(s) for s in kernels.simt_kernel_symbols(name + "<")
                     if s.startswith("void ") and _template(s).endswith("::" + name)
                     and "{lambda" not in s}
    return {i: p for i, (_, p) in found.items()}, compiled


def test_row_probes_reach_every_row_instance(row_plan):
    found, compiled = row_plan
    assert {_template(i).split("::")[-1] for i in found} == set(ROW_TEMPLATES)
    assert all(_template(i).split("::")[-1] in ROW_TEMPLATES for i in found), \
        "norm_scope 1 launched a per-head kernel"
    missing = sorted(compiled - set(found))
    assert not missing, (f"{len(missing)} of {len(compiled)} row-scope instances are selected by "
                         f"none of the probes (extend PROBE_*): " + "; ".join(missing[:6]))


@pytest.mark.parametrize("dtype, weights_fp32", [(torch.float32, False), (torch.float16, False),
                                                  (torch.bfloat16, False), (torch.bfloat16, True)],
                         ids=("fp32", "fp16", "bf16", "bf16-fp32-weights"))
def test_every_row_instance_bit_exact(row_plan, device, dtype, weights_fp32):
    """Every row-scope instance the launcher picks, at the smallest problem that selects it,
    random inputs (the CPU build sums in the kernel's order): bit for bit, every output element
    written, nothing outside; also with float32 [heads * head_dim] weights under bf16."""
    found, _ = row_plan
    failures, ran = [], 0
    for inst, prob in sorted(found.items()):
        if prob["dtype"] != dtype:
            continue
        p = dict(prob)
        p.pop("dtype")
        use_device(p.pop("model"))
        try:
            launches = run_checked(dtype, grid=False, seed=5, norm_scope=ROW,
                                   weights_fp32=weights_fp32, **p)
            got = {_instance(rec["kernel"]) for rec in launches}
            assert got == {inst}, f"the launcher chose {got}, the dry run {inst}"
            ran += 1
        except AssertionError as exc:
            failures.append(f"{inst} {prob}: {str(exc).splitlines()[0]}")
    use_device()
    assert not failures, f"{len(failures)} instance(s) failed:\n" + "\n".join(failures[:10])
    assert ran, "no row-scope instance of this dtype was reached"


def test_wan_row_grid_strides_and_misalignment(device):
    """Wan 1.3B's head layout (12 x 128, bf16, FLUX's order on the row) on a 1-SM device (every
    block walks several tokens through the ring) and with a misaligned q (the general row path)."""
    kernels.simt_configure(num_sms=1, blocks_per_sm=1)
    launches = run_checked(torch.bfloat16, 128, 128, heads=12, batch=2, seq=5, rounding=2,
                           grid=False, seed=8, norm_scope=ROW, check_fp32=True)
    assert "qkNormRopeRowKernel" in launches[0]["kernel"]
    launches = run_checked(torch.bfloat16, 128, 128, heads=12, batch=1, seq=3, rounding=2,
                           grid=False, seed=9, norm_scope=ROW, misalign=("q",))
    assert "qkNormRopeGeneralRowKernel" in launches[0]["kernel"]
