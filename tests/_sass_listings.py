"""Synthetic ``cuobjdump -sass`` listings for the SASS reader's and the kernel report's tests: the
analysis runs on them without the CUDA tools, so it can be shown to fail."""

from __future__ import annotations


def sass_listing(lines, fn="_Z4fakev", arch=90):
    """cuobjdump -sass text for one function; instruction k sits at address 16*k."""
    body = "".join(f"        /*{16 * k:04x}*/                   {t} ;"
                   f"                                      /* 0x000000000000 */\n"
                   f"                                                                 /* 0x000fe2 */\n"
                   for k, t in enumerate(lines))
    return (f"\n\tcode for sm_{arch}\n\t\tFunction : {fn}\n"
            f'\t.headerflags\t@"EF_CUDA_SM{arch} EF_CUDA_VIRTUAL_SM(EF_CUDA_SM{arch})"\n' + body)


def loop_kernel(qk_load="LDG.E.EF.128", store="STG.E.128", pad=0, extra=()):
    """A fast-path-like kernel: a loop at 0x30 loading two 128-bit rows and a 32-bit cos value,
    a guarded MUFU, two 128-bit stores, and a back edge; `pad` FADDs inside the loop."""
    lines = [
        "LDC R1, c[0x0][0x28]",
        "LDG.E.128.CONSTANT R16, desc[UR8][R16.64]",
        "S2R R3, SR_TID.X",
        f"{qk_load} R20, desc[UR8][R2.64]",            # 0x30: loop head
        "LDG.E.EF.128 R24, desc[UR8][R4.64]",
        "LDG.E.CONSTANT R30, desc[UR8][R10.64]",
        "FMUL R8, R20, R20",                           # consumes the first load
        "@P1 BRA 0x90",
        "MUFU.RSQ R9, R8",                             # skipped by the branch above
        "NOP",
        "FFMA R10, R24, R9, R30",
    ]
    lines += ["FADD R11, R11, R10"] * pad + list(extra)
    lines += [f"{store} desc[UR8][R6.64], R20", f"{store} desc[UR8][R12.64], R24"]
    head = 0x30
    lines += [f"@!P0 BRA 0x{head:x}", "EXIT", f"BRA 0x{16 * (len(lines) + 2):x}"]
    return lines


def control_word(wr=None, rd=None, wait=(), stall=1) -> int:
    """The high 64-bit word of an instruction carrying these control bits (bits 41-61: stall,
    yield, write scoreboard, read scoreboard, wait mask; 7 = no scoreboard)."""
    mask = sum(1 << k for k in wait)
    c = (stall & 15) | ((7 if wr is None else wr) << 5) | ((7 if rd is None else rd) << 8) | (mask << 11)
    return c << 41


def controlled_listing(rows, fn="_Z4fakev", arch=90):
    """cuobjdump -sass text whose instructions carry encodings: rows of (text, control dict)."""
    body = "".join(f"        /*{16 * k:04x}*/                   {t} ;"
                   f"                                      /* 0x{0:016x} */\n"
                   f"                                                                 "
                   f"/* 0x{control_word(**c):016x} */\n"
                   for k, (t, c) in enumerate(rows))
    return (f"\n\tcode for sm_{arch}\n\t\tFunction : {fn}\n"
            f'\t.headerflags\t@"EF_CUDA_SM{arch} EF_CUDA_VIRTUAL_SM(EF_CUDA_SM{arch})"\n' + body)


# Known-answer kernels for the scoreboard reader, compiled for sm_90 by tests/test_sass.py (nvcc
# -cubin, cuobjdump -sass). Their answers follow from the source alone:
#   copyN<N>: N independent 128-bit loads per iteration, then N stores each waiting for its own
#     load: at the k-th wait (k = 1..N) N - k + 1 loads are pending and N - k stay outstanding,
#     so N x 16 B are in flight at the first wait and nothing past the last (no prefetch across
#     iterations);
#   cpAsyncDouble: a cp.async double buffer (wait_group 1 after committing the next tile): at
#     each wait two 16-byte groups are pending and one stays outstanding past it.
KNOWN_ANSWER_CU = r"""
#include <cuda_pipeline_primitives.h>
template <int N>
__global__ void copyN(const uint4* __restrict__ in, uint4* __restrict__ out, int n)
{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    int const stride = gridDim.x * blockDim.x;
    for (; i + (N - 1) * stride < n; i += N * stride)
    {
        uint4 v[N];
#pragma unroll
        for (int k = 0; k < N; ++k) v[k] = __ldcs(in + i + k * stride);
#pragma unroll
        for (int k = 0; k < N; ++k) out[i + k * stride] = v[k];
    }
}
template __global__ void copyN<1>(const uint4*, uint4*, int);
template __global__ void copyN<2>(const uint4*, uint4*, int);
template __global__ void copyN<4>(const uint4*, uint4*, int);

__global__ void cpAsyncDouble(const uint4* __restrict__ in, uint4* __restrict__ out, int tiles)
{
    __shared__ uint4 buf[2][256];
    int const tid = threadIdx.x;
    const uint4* src = in + blockIdx.x * 256 + tid;
    int const step = gridDim.x * 256;
    __pipeline_memcpy_async(&buf[0][tid], src, 16);
    __pipeline_commit();
    for (int t = 0; t < tiles; ++t)
    {
        if (t + 1 < tiles) __pipeline_memcpy_async(&buf[(t + 1) & 1][tid], src + (t + 1) * step, 16);
        __pipeline_commit();
        __pipeline_wait_prior(1);
        uint4 v = buf[t & 1][tid];
        v.x += 1;
        out[blockIdx.x * 256 + tid + t * step] = v;
    }
}
"""
