"""The SIMT emulator itself (plugins/simt), through its self-test kernels (libsimt_selftest.so,
plugins/simt/tests/simt_selftest.cpp): shuffle semantics for every width against a model of the
CUDA rules, deadlock / misuse reports, __syncthreads, __shared__, vote / match / reduce, the
device's conversions and __frsqrt_rn; and the emulator's C control API (simt_capi.h) as the
libraries export it."""

from __future__ import annotations

import ctypes
import re
import shutil
import subprocess
import threading
import time

import pytest
import torch

from _simt import SIMT_SRC
from _simt import device, libs  # noqa: F401 (pytest fixtures)
from qkrope.runtime import kernels


# ---- the emulator itself ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def selftest(libs):
    lib = ctypes.CDLL(str(libs / "libsimt_selftest.so"))
    i32p = ctypes.POINTER(ctypes.c_int32)
    f32p = ctypes.POINTER(ctypes.c_float)
    lib.simt_selftest_shfl.argtypes = [ctypes.c_int32, ctypes.c_int32, i32p, ctypes.c_int32, i32p, f32p]
    lib.simt_selftest_misuse.argtypes = [ctypes.c_int32, ctypes.c_int32, ctypes.c_int32, i32p]
    lib.simt_selftest_skip.argtypes = [ctypes.c_int32, i32p]
    lib.simt_selftest_syncthreads.argtypes = [ctypes.c_int32, ctypes.c_int32, i32p]
    lib.simt_selftest_shared_isolation.argtypes = [ctypes.c_int32, ctypes.c_int32, i32p]
    lib.simt_selftest_vote.argtypes = [i32p]
    lib.simt_selftest_async_copy.argtypes = [ctypes.c_int32, i32p, i32p]
    lib.simt_selftest_exit_early.argtypes = [i32p]
    lib.simt_set_strict_exit.argtypes = [ctypes.c_int32]
    lib.simt_selftest_convert.argtypes = [f32p, ctypes.c_void_p, ctypes.c_void_p, f32p, f32p, ctypes.c_int32]
    lib.simt_selftest_frsqrt.argtypes = [f32p, f32p, ctypes.c_int32]
    lib.simt_last_error.restype = ctypes.c_char_p
    lib.simt_configure.argtypes = [ctypes.c_int32, ctypes.c_int32, ctypes.c_int64]
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
                assert rc == 0, selftest.simt_last_error().decode()
                model = _shfl_model(op, width, args.tolist(), n)
                assert out.tolist() == model, (op, width, args.tolist())
                assert fout.tolist() == [m + 0.5 for m in model]
    for width in (w for w in range(1, 33) if w & (w - 1)):  # not a power of two: reported
        rc = selftest.simt_selftest_shfl(3, width, _ptr(torch.ones(32, dtype=torch.int32)), 32,
                                         _ptr(out), _ptr(fout, ctypes.c_float))
        assert rc != 0 and "power of two" in selftest.simt_last_error().decode()


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
    msg = selftest.simt_last_error().decode()
    assert rc == (716 if mode == 9 else 719), (rc, msg)
    assert re.search(expect, msg), msg
    assert "misuseKernel" in msg and "block (0,0,0)" in msg and "simt_selftest.cpp:" in msg, msg
    # The emulator detects the misuse from its fibers' states, not by a timeout, so it returns
    # in milliseconds; this only tells "reported" from "hung" (a generous guard, not a timing).
    assert time.monotonic() - t0 < 120


@pytest.mark.parametrize("seed", [0, 3])
def test_lane_skipping_a_shuffle_is_a_reported_deadlock(selftest, device, seed):
    selftest.simt_configure(-1, -1, seed)
    for lane in (0, 17, 31):
        rc = selftest.simt_selftest_skip(lane, _ptr(torch.zeros(32, dtype=torch.int32)))
        msg = selftest.simt_last_error().decode()
        assert rc == 719 and "__shfl_xor_sync" in msg, msg
        assert f"reads lane {lane}, which exited without taking part" in msg, msg
    selftest.simt_set_strict_exit(1)   # strict: the exit itself is the error
    rc = selftest.simt_selftest_skip(5, _ptr(torch.zeros(32, dtype=torch.int32)))
    msg = selftest.simt_last_error().decode()
    selftest.simt_set_strict_exit(0)
    assert rc == 719 and "deadlock (strict)" in msg and "lane 5" in msg, msg
    selftest.simt_configure(-1, -1, 0)
    out = torch.zeros(32, dtype=torch.int32)
    assert selftest.simt_selftest_skip(-1, _ptr(out)) == 0   # nobody skips: fine
    assert out.tolist() == [lane ^ 1 for lane in range(32)]


def test_exited_lanes_need_not_take_part(selftest, device):
    """CUDA: only the non-exited lanes named in a mask must execute the collective."""
    out = torch.full((32,), -1, dtype=torch.int32)
    assert selftest.simt_selftest_exit_early(_ptr(out)) == 0, selftest.simt_last_error()
    assert out.tolist() == [(lane ^ 1) + 100 for lane in range(16)] + [-1] * 16


@pytest.mark.parametrize("seed", [0, 9])
def test_syncthreads_is_a_block_barrier(selftest, device, seed):
    selftest.simt_configure(-1, -1, seed)
    blocks, n = 3, 96
    out = torch.zeros(blocks * n, dtype=torch.int32)
    assert selftest.simt_selftest_syncthreads(blocks, n, _ptr(out)) == 0
    expected = [7 * ((t + 1) % n) + 1000 * b for b in range(blocks) for t in range(n)]
    assert out.tolist() == expected
    selftest.simt_configure(-1, -1, 0)


def test_async_copies_land_only_when_their_group_is_waited_for(selftest, device):
    """cp.async (__pipeline_memcpy_async / commit / wait_prior): a read before the wait sees the
    slot's old contents (-1), wait_prior(N) lands all but the N newest groups, and after the last
    wait and a barrier every thread sees every thread's copies."""
    n = 64
    src = torch.arange(3 * n * 4, dtype=torch.int32)          # group g, thread t: int4 at (g*n + t)
    out = torch.zeros(6 * n, dtype=torch.int32)
    assert selftest.simt_selftest_async_copy(n, _ptr(src), _ptr(out)) == 0
    first = [4 * (g * n + t) for g in range(3) for t in range(n)]   # .x of each copy
    got = out.view(n, 6).tolist()
    for t in range(n):
        assert got[t] == [-1, first[t], -1, first[n + t], first[2 * n + t],
                          first[2 * n + (t + 1) % n]], t
    # a misaligned source is reported, not copied
    assert selftest.simt_selftest_async_copy(n, ctypes.cast(src.data_ptr() + 4, ctypes.POINTER(ctypes.c_int32)),
                                             _ptr(out)) != 0
    assert "__pipeline_memcpy_async" in selftest.simt_last_error().decode()


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



# ---- the C control API, as the libraries export it ---------------------------------------------------
def _capi_names() -> tuple[set[str], dict[str, str]]:
    """(the functions simt_capi.h declares, {former name: function} of its deprecated aliases)."""
    text = (SIMT_SRC / "simt_capi.h").read_text()
    new = set(re.findall(r"^SIMT_API (?!SIMT_DEPRECATED)[^;(]*?\b(simt_\w+)\(", text, re.M))
    aliases = {old: name for name, old in re.findall(
        r"^SIMT_API SIMT_DEPRECATED\((simt_\w+)\) [^;(]*?\b(qkrope_simt_\w+)\(", text, re.M)}
    return new, aliases


@pytest.mark.parametrize("which", ["libqkrope_kernels_simt.so", "libsimt_selftest.so"])
def test_capi_exported_under_its_names_and_the_former_aliases(libs, which):
    """Every function of simt_capi.h is exported as simt_* and, for a while, under its former
    name qkrope_simt_* -- the same function (one address) -- and no other name of either kind."""
    new, aliases = _capi_names()
    assert len(new) >= 10, f"simt_capi.h declarations not recognised: {sorted(new)}"
    assert set(aliases.values()) == new, "every function keeps its former name as an alias"
    assert all(old == "qkrope_" + name for old, name in aliases.items()), aliases
    nm = shutil.which("nm")
    if nm is None:
        pytest.skip("nm (binutils) not available to list the library's symbols")
    path = libs / which
    out = subprocess.run([nm, "-D", "--defined-only", str(path)], capture_output=True, text=True,
                         check=True).stdout
    names = {line.split()[-1] for line in out.splitlines() if line.strip()}
    assert {n for n in names if n.startswith("simt_") and not n.startswith("simt_selftest_")} == new
    assert {n for n in names if n.startswith("qkrope_simt_")} == set(aliases)
    lib = ctypes.CDLL(str(path))
    for old, name in sorted(aliases.items()):
        assert (ctypes.cast(getattr(lib, old), ctypes.c_void_p).value
                == ctypes.cast(getattr(lib, name), ctypes.c_void_p).value), f"{old} is not {name}"
    assert lib.qkrope_simt_version() == lib.simt_version() == 1
    if which == kernels.SIMT_LIB_NAME:
        assert path.resolve() == kernels.simt_library_path().resolve()
