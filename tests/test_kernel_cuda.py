"""The fused CUDA kernel (libqkrope_kernels.so through qkrope.runtime.kernels.cuda_qk_norm_rope)
against the PyTorch reference: the same matrix as tests/test_kernel_host.py, plus the general
path (misaligned tensors), the y-split and grid-stride paths, in-place use and 64-bit offsets.
Numerical policy: tests/_kernel_cases.py. Skipped without a CUDA GPU.

The library is taken from QKROPE_KERNELS_LIB or build/plugins / build/kernel; if it is missing it
is built here (cmake on plugins/kernel with CUDA, for this GPU's compute capability).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from _kernel_cases import (CASES, LAUNCH_LAYOUTS, assert_bit_exact, layout_id, assert_within_order_policy,
                           case_id, check_against_fp32, make_inputs, reference)
from qkrope import families
from qkrope.runtime import kernels, toolchain

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="requires CUDA")]

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def cuda_lib():
    path = kernels.cuda_library_path()
    if path is not None and path.is_file():
        yield path
        return
    cmake = shutil.which("cmake")
    nvcc = toolchain.find_nvcc()
    if cmake is None or nvcc is None:
        pytest.fail(f"{kernels.CUDA_LIB_NAME} is missing and cmake/nvcc are not available to build "
                    f"it; build it with: {kernels.CUDA_BUILD_COMMAND}")
    build = toolchain.KERNEL_BUILD_DIR
    subprocess.run([cmake, "-S", str(REPO / "plugins" / "kernel"), "-B", str(build),
                    "-DQKROPE_WITH_CUDA=ON", f"-DCMAKE_CUDA_COMPILER={nvcc}",
                    # this GPU's arch, explicitly: "native" needs cmake >= 3.24
                    f"-DCMAKE_CUDA_ARCHITECTURES={kernels.cuda_arch_for_cmake(cmake)}"], check=True)
    subprocess.run([cmake, "--build", str(build), "-j4"], check=True)
    lib = build / kernels.CUDA_LIB_NAME
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(kernels.CUDA_LIB_ENV, str(lib))
        yield lib


def _run(inputs, **kw):
    outs = kernels.cuda_qk_norm_rope(*inputs, **kw)
    torch.cuda.synchronize()
    return outs


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_reference(cuda_lib, case):
    dtype, interleaved, rounding, (head_dim, rotary_dim) = case
    kw = dict(interleaved=interleaved, rounding=rounding)
    inputs = make_inputs(dtype, head_dim, rotary_dim, seed=head_dim + rotary_dim, device="cuda")
    outs = _run(inputs, **kw)
    check_against_fp32(outs, inputs, dtype, interleaved)
    if dtype != torch.float32:
        assert_within_order_policy(outs, reference(*inputs, **kw), dtype, rounding)
    grid = make_inputs(dtype, head_dim, rotary_dim, grid=True, seed=7, device="cuda")
    assert_bit_exact(_run(grid, **kw), reference(*grid, **kw))


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """The same values in a contiguous tensor whose data pointer is not 16-byte aligned."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = flat[1:].view(t.shape)
    view.copy_(t)
    assert view.is_contiguous() and view.data_ptr() % 16 != 0
    return view


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("interleaved", [True, False])
def test_general_path_matches_fast_path(cuda_lib, dtype, interleaved):
    q, k, qw, kw, cache = make_inputs(dtype, 128, 64, grid=True, seed=11, device="cuda")
    fast = _run((q, k, qw, kw, cache), interleaved=interleaved, rounding=1)
    slow = _run((_misaligned(q), _misaligned(k), qw, kw, cache), interleaved=interleaved, rounding=1)
    assert torch.equal(fast[0], slow[0]) and torch.equal(fast[1], slow[1])
    assert_bit_exact(fast, reference(q, k, qw, kw, cache, interleaved=interleaved, rounding=1))


@pytest.mark.parametrize("batch, seq, heads, head_dim", [
    (1, 37, 24, 128),     # few tokens: rows of a token split over blockIdx.y
    (2, 4000, 2, 64),     # more tokens than the grid: blocks loop over tokens
    (1, 3, 7, 256),       # odd head count
])
def test_grid_shapes(cuda_lib, batch, seq, heads, head_dim):
    inputs = make_inputs(torch.bfloat16, head_dim, head_dim, batch=batch, seq=seq, heads=heads,
                         grid=True, seed=13, device="cuda")
    for interleaved in (True, False):
        kw = dict(interleaved=interleaved, rounding=1)
        assert_bit_exact(_run(inputs, **kw), reference(*inputs, **kw))


@pytest.mark.parametrize("layout", LAUNCH_LAYOUTS, ids=layout_id)
def test_family_launch_layouts_match_the_cpu_build(cuda_lib, layout):
    """Every head layout a family launches (its record's launches), at the longest sequence
    among its launches, in each rounding mode it is planned with, random inputs: the same bits
    as the CPU build of the arithmetic, which sums the squares in the launched path's order."""
    heads, d, rot, inter, roundings = layout
    seq = max(ln.seq for r in families.records() for ln in r.launches
              if (ln.heads, ln.head_dim, ln.rotary, ln.interleaved) == (heads, d, rot, inter))
    inputs = make_inputs(torch.bfloat16, d, rot, batch=1, seq=seq, heads=heads, seed=heads,
                         device="cuda")
    for rounding in roundings:
        kw = dict(interleaved=inter, rounding=rounding)
        got = _run(inputs, **kw)
        assert_bit_exact(got, kernels.host_qk_norm_rope(*(t.cpu() for t in inputs), **kw))
def test_in_place(cuda_lib):
    q, k, qw, kw, cache = make_inputs(torch.bfloat16, 128, 128, batch=1, seq=64, heads=24,
                                      device="cuda")
    expected = _run((q, k, qw, kw, cache))
    kernels.cuda_qk_norm_rope(q, k, qw, kw, cache, out=(q, k))
    torch.cuda.synchronize()
    assert torch.equal(q, expected[0]) and torch.equal(k, expected[1])


def test_bad_params_return_status(cuda_lib):
    q = torch.randn(1, 6, 2, 64, device="cuda")
    w = torch.ones(64, device="cuda")
    with pytest.raises(kernels.KernelStatusError) as e:
        kernels.cuda_qk_norm_rope(q, q.clone(), w, w, torch.zeros(5, 64, device="cuda"))
    assert e.value.status == 4
    with pytest.raises(kernels.KernelStatusError) as e:
        kernels.cuda_qk_norm_rope(q, q.clone(), w, w, torch.zeros(8, 33, device="cuda"))
    assert e.value.status == 3


def test_64bit_offsets(cuda_lib):
    """q and k with more than 2^31 elements each (in place), checked at both ends."""
    heads, head_dim = 16, 128
    per_token = heads * head_dim
    seq = (1 << 31) // per_token + 64
    need = 2 * seq * per_token * 2 + seq * head_dim * 4 + (1 << 30)
    free, _ = torch.cuda.mem_get_info()
    if free < need:
        pytest.skip(f"needs {need / 2**30:.1f} GiB of free GPU memory, {free / 2**30:.1f} GiB free")
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.empty(1, seq, heads, head_dim, dtype=torch.bfloat16, device="cuda")
    k = torch.empty_like(q)
    q.normal_(generator=g)
    k.normal_(generator=g)
    assert q.numel() > 2**31
    w = torch.ones(head_dim, dtype=torch.bfloat16, device="cuda")
    angles = torch.arange(seq, device="cuda", dtype=torch.float32)[:, None] * 1e-3 * torch.arange(
        1, head_dim // 2 + 1, device="cuda", dtype=torch.float32)[None, :]
    cache = torch.cat([angles.cos(), angles.sin()], -1).contiguous()
    del angles
    ends = {n: (x[:, :8].clone(), x[:, -8:].clone()) for n, x in (("q", q), ("k", k))}
    kernels.cuda_qk_norm_rope(q, k, w, w, cache, rounding=1, out=(q, k))
    torch.cuda.synchronize()
    for sl, crow in ((slice(0, 8), cache[:8]), (slice(seq - 8, seq), cache[seq - 8:])):
        which = 0 if sl.start == 0 else 1
        ref = reference(ends["q"][which], ends["k"][which], w, w, crow, rounding=1)
        got = (q[:, sl], k[:, sl])
        assert_within_order_policy(got, ref, torch.bfloat16, rounding=1)
