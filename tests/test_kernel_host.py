"""The kernel's arithmetic (plugins/kernel/qknorm_rope_math.h) compiled for the CPU
(libqkrope_kernel_host.so), checked against the PyTorch reference: every dtype, GPT-J and NeoX
pairing, the three rounding modes, fast-path and general head sizes, partial rotary, caches with more
rows than tokens, and the parameter checks. Numerical policy: tests/_kernel_cases.py.

The library is built here (cmake on plugins/kernel into build/kernel-host) unless
QKROPE_KERNEL_HOST_LIB names one already built.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from _kernel_cases import (CASES, LAUNCH_LAYOUTS, assert_bit_exact, layout_id,
                           assert_within_order_policy, case_id, check_against_fp32, make_inputs,
                           reference)
from _native import build_lock, require_native_tools
from qkrope import contract
from qkrope.runtime import kernels, toolchain

REPO = Path(__file__).resolve().parent.parent
BUILD_DIR = toolchain.KERNEL_HOST_BUILD_DIR


def _build_host_library() -> Path:
    cxx, cmake = require_native_tools("the CPU kernel library")
    with build_lock(BUILD_DIR):
        if not (BUILD_DIR / "CMakeCache.txt").is_file():
            subprocess.run([cmake, "-S", str(REPO / "plugins" / "kernel"), "-B", str(BUILD_DIR),
                            "-DQKROPE_WITH_CUDA=OFF", "-DCMAKE_BUILD_TYPE=Release"],
                           check=True, capture_output=True, text=True)
        res = subprocess.run([cmake, "--build", str(BUILD_DIR), "--target", "qkrope_kernel_host",
                              "-j2"], capture_output=True, text=True)
    assert res.returncode == 0, f"building the CPU kernel library failed:\n{res.stdout}\n{res.stderr}"
    lib = BUILD_DIR / kernels.HOST_LIB_NAME
    assert lib.is_file(), f"{lib} was not produced"
    return lib


@pytest.fixture(scope="module")
def host_lib():
    explicit = os.environ.get(kernels.HOST_LIB_ENV)
    if explicit:
        yield Path(explicit)
        return
    lib = _build_host_library()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(kernels.HOST_LIB_ENV, str(lib))
        yield lib


def _run(inputs, **kw):
    return kernels.host_qk_norm_rope(*inputs, **kw)


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_reference(host_lib, case):
    dtype, interleaved, rounding, (head_dim, rotary_dim) = case
    kw = dict(interleaved=interleaved, rounding=rounding)

    # arbitrary inputs: accuracy against fp32, and the reference of the same dtype/mode
    inputs = make_inputs(dtype, head_dim, rotary_dim, seed=head_dim + rotary_dim)
    outs = _run(inputs, **kw)
    check_against_fp32(outs, inputs, dtype, interleaved)
    if dtype != torch.float32:
        assert_within_order_policy(outs, reference(*inputs, **kw), dtype, rounding)

    # inputs with an exact sum of squares: bit-exact with the reference in every dtype and mode
    grid = make_inputs(dtype, head_dim, rotary_dim, grid=True, seed=7)
    assert_bit_exact(_run(grid, **kw), reference(*grid, **kw))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_qwen_image_shape_rounding1(host_lib, dtype):
    """Qwen-Image's head layout (24 x 128), diffusers' rounding order, many random rows."""
    inputs = make_inputs(dtype, 128, 128, batch=1, seq=48, heads=24, extra_rows=16, seed=3)
    kw = dict(interleaved=True, rounding=1)
    outs = _run(inputs, **kw)
    check_against_fp32(outs, inputs, dtype, True)
    assert_within_order_policy(outs, reference(*inputs, **kw), dtype, rounding=1)


def test_in_place(host_lib):
    q, k, qw, kw, cache = make_inputs(torch.bfloat16, 128, 64, seed=5)
    expected = _run((q, k, qw, kw, cache))
    q2, k2 = q.clone(), k.clone()
    outs = kernels.host_qk_norm_rope(q2, k2, qw, kw, cache, out=(q2, k2))
    assert outs[0] is q2 and torch.equal(q2, expected[0]) and torch.equal(k2, expected[1])


def test_fp32_rounding_modes_identical(host_lib):
    inputs = make_inputs(torch.float32, 96, 64, seed=9)
    a = _run(inputs, rounding=0)
    for rounding in contract.ROUNDING_MODES[1:]:
        b = _run(inputs, rounding=rounding)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("layout", LAUNCH_LAYOUTS, ids=layout_id)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_family_launch_layouts(host_lib, dtype, layout):
    """Every head layout a family launches (its record's launches), in each rounding mode it is
    planned with: bit-exact with the reference on grid inputs, within the order policy on random
    rows."""
    heads, d, rot, inter, roundings = layout
    for rounding in roundings:
        kw = dict(interleaved=inter, rounding=rounding)
        grid = make_inputs(dtype, d, rot, batch=1, seq=4, heads=heads, grid=True, seed=heads)
        assert_bit_exact(_run(grid, **kw), reference(*grid, **kw))
        inputs = make_inputs(dtype, d, rot, batch=1, seq=16, heads=heads, seed=heads + 1)
        outs = _run(inputs, **kw)
        check_against_fp32(outs, inputs, dtype, inter)
        assert_within_order_policy(outs, reference(*inputs, **kw), dtype, rounding=rounding)


def test_empty_problem(host_lib):
    q, k, qw, kw, cache = make_inputs(torch.float16, 64, 64, seq=0, extra_rows=2)
    outs = _run((q, k, qw, kw, cache))
    assert outs[0].shape == q.shape and outs[0].numel() == 0


def _status(exc_info) -> int:
    return exc_info.value.status


@pytest.mark.parametrize("what, head_dim, cache_shape, extra, status", [
    ("cache overflow", 64, (5, 64), {}, 4),            # 6 tokens, 5 rows
    ("odd rotary dim", 64, (8, 33), {}, 3),
    ("rotary > head_dim", 64, (8, 66), {}, 3),
    ("head_dim > 512", 514, (8, 64), {}, 2),
    ("odd head_dim", 63, (8, 32), {}, 2),
    ("rounding 3", 64, (8, 64), {"rounding": 3}, 6),     # contract.ROUNDING_MODES: 0, 1, 2
    ("rounding -1", 64, (8, 64), {"rounding": -1}, 6),
    ("eps 0", 64, (8, 64), {"eps": 0.0}, 6),
    ("eps nan", 64, (8, 64), {"eps": float("nan")}, 6),
    # the contract's one epsilon rule (qkrope/contract.py epsilon_error): 0 < eps < 1
    ("eps 1", 64, (8, 64), {"eps": 1.0}, 6),
    ("eps 2", 64, (8, 64), {"eps": 2.0}, 6),
    ("eps inf", 64, (8, 64), {"eps": float("inf")}, 6),
    ("eps -1", 64, (8, 64), {"eps": -1.0}, 6),
])
def test_bad_params_return_status(host_lib, what, head_dim, cache_shape, extra, status):
    shape = (2, 6, 2, head_dim)
    q = torch.randn(shape)
    k = torch.randn(shape)
    w = torch.ones(head_dim)
    cache = torch.zeros(cache_shape)
    with pytest.raises(kernels.KernelStatusError) as exc_info:
        kernels.host_qk_norm_rope(q, k, w, w, cache, **extra)
    assert _status(exc_info) == status, what
    text = kernels._load(kernels.HOST_LIB_ENV, kernels.HOST_LIB_NAME, "", "qkrope_host_run",
                         "qkrope_host_status_string", cuda=False).qkrope_host_status_string(status)
    assert text.decode() in str(exc_info.value)


def test_null_pointer_and_bad_dtype_codes(host_lib):
    lib = ctypes.CDLL(str(host_lib))
    fn = lib.qkrope_host_run
    fn.restype = ctypes.c_int32
    fn.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_int64] * 6 + [ctypes.c_float] + [ctypes.c_int32] * 3
    args = [None] * 7 + [1, 2, 2, 64, 64, 2, 1e-6, 1, 0]
    assert fn(*args, 0) == 1           # kNULL_POINTER
    assert fn(*args, 7) == 5           # kBAD_DTYPE
    empty = [None] * 7 + [0, 2, 2, 64, 64, 2, 1e-6, 1, 0, 2]
    assert fn(*empty) == 0             # nothing to do: pointers may be null
    lib.qkrope_host_status_string.restype = ctypes.c_char_p
    assert b"overflow" in lib.qkrope_host_status_string(4)
    assert lib.qkrope_host_capi_version() == 3
    v3 = lib.qkrope_host_run_v3
    v3.restype = ctypes.c_int32
    v3.argtypes = fn.argtypes + [ctypes.c_int32] * 2
    # weight_dtype: the activations' own (2 = bf16) or 0 (float32); 1 (fp16) under bf16 is refused
    assert v3(*empty[:-1], 0, 2, 2) == 0 and v3(*empty[:-1], 0, 2, 0) == 0
    assert v3(*empty[:-1], 0, 2, 1) == 5 and v3(*empty[:-1], 0, 2, 9) == 5  # kBAD_DTYPE


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("norm_scope", [0, 1], ids=["head", "row"])
def test_fp32_weights_match_reference(host_lib, dtype, norm_scope):
    """float32 norm weights under 16-bit activations (FLUX.3): with an exact sum of squares,
    bit-exact with the reference in every rounding mode and pairing, full and partial rotary;
    and the weights' low bits matter (the same weights rounded to the dtype give other outputs:
    the library did not read the float32 tensor as the activation type or round it)."""
    from _kernel_cases import row_weights
    for (d, r), inter, rounding in itertools.product(((128, 128), (96, 32)), (True, False),
                                                     contract.ROUNDING_MODES):
        kw = dict(interleaved=inter, rounding=rounding, norm_scope=norm_scope)
        grid = make_inputs(dtype, d, r, grid=True, seed=d + rounding, weights_fp32=True)
        grid = row_weights(grid) if norm_scope == 1 else grid
        assert grid[2].dtype == torch.float32 and grid[0].dtype == dtype
        outs = _run(grid, **kw)
        assert_bit_exact(outs, reference(*grid, **kw))
        rounded = (*grid[:2], grid[2].to(dtype), grid[3].to(dtype), grid[4])
        assert any(not torch.equal(a, b) for a, b in zip(outs, _run(rounded, **kw))), \
            f"d{d} rot{r} rounding {rounding}: float32 weights gave the rounded weights' outputs"


def test_weight_dtypes_refused(host_lib):
    """Weights in a third dtype, or q_weight and k_weight of two dtypes: refused in one line."""
    q, k, qw, kw, cache = make_inputs(torch.bfloat16, 64, 64)
    with pytest.raises(ValueError, match=r"q_weight must be \[64\] in q's dtype .* or float32"):
        kernels.host_qk_norm_rope(q, k, qw.half(), kw.half(), cache)
    with pytest.raises(ValueError, match="must share one dtype"):
        kernels.host_qk_norm_rope(q, k, qw.float(), kw, cache)


def test_python_side_checks(host_lib):
    q, k, qw, kw, cache = make_inputs(torch.float32, 64, 64)
    with pytest.raises(ValueError, match="contiguous"):
        kernels.host_qk_norm_rope(q.transpose(1, 2), k.transpose(1, 2), qw, kw, cache)
    with pytest.raises(ValueError, match="float32"):
        kernels.host_qk_norm_rope(q, k, qw, kw, cache.double())
    with pytest.raises(ValueError, match="dtype"):
        kernels.host_qk_norm_rope(q, k.half(), qw, kw, cache)


def _bad_outs(q, k, qw, kw, cache):
    """(id, out) pairs the bindings must refuse before the library is called."""
    big = torch.empty(q.numel() * 2, dtype=q.dtype)
    joint = torch.empty(2 * q.numel(), dtype=q.dtype)
    return [
        ("not a pair", (torch.empty_like(q),)),
        ("not tensors", (None, None)),
        ("short q_out", (torch.empty(q.shape[0], q.shape[1] - 1, *q.shape[2:], dtype=q.dtype),
                         torch.empty_like(k))),
        ("flat k_out", (torch.empty_like(q), torch.empty(k.numel(), dtype=k.dtype))),
        ("wrong dtype", (torch.empty_like(q, dtype=torch.float16), torch.empty_like(k))),
        ("wrong device", (torch.empty_like(q, device="meta"), torch.empty_like(k))),
        ("non-contiguous", (torch.empty_like(q).transpose(1, 2).contiguous().transpose(1, 2),
                            torch.empty_like(k))),
        ("q_out is k", (k, torch.empty_like(k))),
        ("swapped in place", (k, q)),
        ("same tensor twice", (big[: q.numel()].view(q.shape),) * 2),
        ("outputs overlap", (joint[: q.numel()].view(q.shape), joint[1: q.numel() + 1].view(q.shape))),
        ("q_out shifted over q", (_shifted_alias(q), torch.empty_like(k))),
        ("k_out over cache", (torch.empty_like(q), _over(cache, k))),
    ]


def _shifted_alias(q):
    base = torch.empty(q.numel() + 1, dtype=q.dtype)
    base[1:].copy_(q.reshape(-1))
    q.set_(base[1:].view(q.shape))  # q now lives at base[1:]
    return base[: q.numel()].view(q.shape)  # partial overlap with q, not the same start


def _over(cache, like):
    """A tensor shaped like `like` whose bytes start inside the cache's storage."""
    n = like.numel() * like.element_size()
    store = torch.empty(cache.numel() * 4 + n, dtype=torch.uint8)
    store[: cache.numel() * 4].copy_(cache.reshape(-1).view(torch.uint8))
    cache.set_(store[: cache.numel() * 4].view(torch.float32).view(cache.shape))
    return store[8: 8 + n].view(like.dtype).view(like.shape)


@pytest.mark.parametrize("which", ["host", "cuda"])
def test_bad_out_raises_before_the_call(host_lib, monkeypatch, which):
    """A bad out= must be refused in Python: the library writes q.numel() elements through each
    pointer unchecked (a short buffer was an out-of-bounds write, a segfault)."""
    called = []
    monkeypatch.setattr(kernels, "_call", lambda *a, **k: called.append(a))
    if which == "cuda":
        # no GPU needed: every case fails before the library is loaded or anything is launched
        monkeypatch.setattr(kernels, "_load", lambda *a, **k: type("L", (), {
            "qkrope_launch": None, "qkrope_status_string": None})())
        monkeypatch.setattr(kernels, "_check_args", lambda *a, **k: None)
        fn = kernels.cuda_qk_norm_rope
    else:
        fn = kernels.host_qk_norm_rope
    n_cases = len(_bad_outs(*make_inputs(torch.float32, 64, 64)))
    for i in range(n_cases):
        q, k, qw, kw, cache = make_inputs(torch.float32, 64, 64)
        what, out = _bad_outs(q, k, qw, kw, cache)[i]
        with pytest.raises(ValueError, match="out"):
            fn(q, k, qw, kw, cache, out=out)
        assert not called, f"{which}: {what}: the library was called"


def test_good_out_tensors(host_lib):
    q, k, qw, kw, cache = make_inputs(torch.bfloat16, 128, 64, seed=3)
    expected = _run((q, k, qw, kw, cache))
    q_out, k_out = torch.full_like(q, float("nan")), torch.full_like(k, float("nan"))
    outs = kernels.host_qk_norm_rope(q, k, qw, kw, cache, out=(q_out, k_out))
    assert outs[0] is q_out and outs[1] is k_out
    assert torch.equal(q_out, expected[0]) and torch.equal(k_out, expected[1])
    # views of one buffer that do not overlap are fine
    buf = torch.empty(2 * q.numel(), dtype=q.dtype)
    outs = kernels.host_qk_norm_rope(q, k, qw, kw, cache, out=(buf[: q.numel()].view(q.shape),
                                                               buf[q.numel():].view(q.shape)))
    assert torch.equal(outs[0], expected[0]) and torch.equal(outs[1], expected[1])


def test_missing_library_message(monkeypatch, tmp_path):
    monkeypatch.setenv(kernels.HOST_LIB_ENV, str(tmp_path / "nope.so"))
    q, k, qw, kw, cache = make_inputs(torch.float32, 64, 64)
    with pytest.raises(kernels.KernelLibraryError, match="cmake -S plugins/kernel"):
        kernels.host_qk_norm_rope(q, k, qw, kw, cache)


def test_exports_only_c_abi(host_lib):
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) not available to list the library's symbols")
    out = subprocess.run([nm, "-D", "--defined-only", str(host_lib)], capture_output=True,
                         text=True, check=True).stdout
    names = sorted(line.split()[-1] for line in out.splitlines() if line.strip())
    assert names == ["qkrope_host_capi_version", "qkrope_host_run", "qkrope_host_run_scoped",
                     "qkrope_host_run_v3", "qkrope_host_status_string"]
