// qkrope: the per-row arithmetic of QKNormRoPE (docs/spec.md section 3), shared by the CUDA kernel
// and the host-only CPU build used by the tests. Everything here is __host__ __device__ and
// compiles with plain g++ (no CUDA headers) as well as with nvcc and under the SIMT emulation.
//
// Numerics (chosen so that the host build, the CUDA kernel and the PyTorch reference agree):
//   - all maths in fp32; every multiply/add is an explicit, separately rounded IEEE operation
//     (on the device through __fmul_rn/__fadd_rn/__fsub_rn, on the host by building with
//     -ffp-contract=off), in the same order as export/reference.py, except the sum of squares,
//     which accumulates with fused multiply-adds (one rounding per element instead of two);
//   - the sum of squares is the only place where the order differs from torch. Its order is a
//     defined function of the kernel path (qknorm_rope_plan.h: SumLayout): per-lane partial sums
//     over the lane's chunks in element order, then a butterfly over the lanes. The host build
//     (sumSquares below) reproduces it exactly, so host and device agree bit for bit;
//   - inv = 1 / sqrt(sum(x^2) / D + eps), correctly rounded division and sqrt (what torch.rsqrt
//     computes on the CPU); for a power-of-two D the division by D is an exact multiplication;
//   - fp16/bf16 <-> fp32 conversions round to nearest even, bit-exact with torch's for every
//     non-NaN value; every NaN becomes one quiet NaN (bf16 0x7FC0, fp16 0x7E00: torch's scalar
//     casts of +NaN), sign and payload dropped, on the host, under the emulation and on the
//     device alike (the hardware conversions give 0x7FFF, so the device code canonicalises).
//     torch's own casts may keep a NaN's sign or payload (its vectorised bf16 cast turns -NaN
//     into 0xFFFF), so against torch only the NaN positions agree, not always their bits;
//   - rounding = 0: y = (x * inv) * w in fp32, rotate in fp32, round once.
//     rounding = 1: y = round(round(x * inv) * w) (diffusers' RMSNorm order, Qwen-Image), rotate
//     in fp32, round once.
//     rounding = 2: y = round((x * inv) * w) (torch's RMSNorm, FLUX's norm_q/norm_k), rotate in
//     fp32 (diffusers' apply_rotary_emb), round once.
//     With fp32 activations the three modes are the same computation.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define QKROPE_HD __host__ __device__ __forceinline__
#else
#define QKROPE_HD inline
#endif

namespace qkrope
{
namespace math
{

// ---------------------------------------------------------------------------------------------
// Separately rounded fp32 operations (never contracted into an FMA).
QKROPE_HD float mul(float a, float b)
{
#if defined(__CUDA_ARCH__)
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}

QKROPE_HD float add(float a, float b)
{
#if defined(__CUDA_ARCH__)
    return __fadd_rn(a, b);
#else
    return a + b;
#endif
}

QKROPE_HD float sub(float a, float b)
{
#if defined(__CUDA_ARCH__)
    return __fsub_rn(a, b);
#else
    return a - b;
#endif
}

// acc + x * x with one rounding (the sum-of-squares step).
QKROPE_HD float fmaSquare(float x, float acc)
{
#if defined(__CUDA_ARCH__)
    return __fmaf_rn(x, x, acc);
#else
    return std::fma(x, x, acc);
#endif
}

// 1 / sqrt(meanSq + eps): correctly rounded sqrt, then a correctly rounded reciprocal.
QKROPE_HD float invSqrt(float meanSqPlusEps)
{
#if defined(__CUDA_ARCH__)
    return __frcp_rn(__fsqrt_rn(meanSqPlusEps));
#else
    return 1.0F / std::sqrt(meanSqPlusEps);
#endif
}

// 1 / sqrt(sumSq / D + eps) for any D: IEEE division by D.
QKROPE_HD float rmsInv(float sumSq, int headDim, float eps)
{
#if defined(__CUDA_ARCH__)
    return invSqrt(__fadd_rn(__fdiv_rn(sumSq, static_cast<float>(headDim)), eps));
#else
    return invSqrt(sumSq / static_cast<float>(headDim) + eps);
#endif
}

// The same for a power-of-two D known at compile time: sumSq * (1/D) is exact and equal to the
// IEEE division (both are the correctly rounded sumSq / D), without a division on the device.
template <int HEAD_DIM>
QKROPE_HD float rmsInvPow2(float sumSq, float eps)
{
    static_assert(HEAD_DIM > 0 && (HEAD_DIM & (HEAD_DIM - 1)) == 0, "power-of-two head_dim only");
    return invSqrt(add(mul(sumSq, 1.0F / static_cast<float>(HEAD_DIM)), eps));
}

// ---------------------------------------------------------------------------------------------
// Bit casts and conversions.
QKROPE_HD uint32_t floatBits(float f)
{
#if defined(__CUDA_ARCH__)
    return __float_as_uint(f);
#else
    uint32_t u;
    std::memcpy(&u, &f, sizeof(u));
    return u;
#endif
}

QKROPE_HD float bitsFloat(uint32_t u)
{
#if defined(__CUDA_ARCH__)
    return __uint_as_float(u);
#else
    float f;
    std::memcpy(&f, &u, sizeof(f));
    return f;
#endif
}

// The one quiet NaN every conversion below returns for a NaN input (torch's scalar cast of +NaN).
constexpr uint16_t kBf16CanonicalNaN = 0x7FC0U;
constexpr uint16_t kFp16CanonicalNaN = 0x7E00U;

// bfloat16: the upper 16 bits of an fp32, round to nearest even; any NaN -> 0x7FC0.
QKROPE_HD float bf16ToFloat(uint16_t h)
{
    return bitsFloat(static_cast<uint32_t>(h) << 16);
}

QKROPE_HD uint16_t floatToBf16(float f)
{
#if defined(__CUDA_ARCH__)
    if (f != f)
    {
        return kBf16CanonicalNaN; // the hardware conversion would give 0x7FFF
    }
    return __bfloat16_as_ushort(__float2bfloat16_rn(f));
#else
    uint32_t const u = floatBits(f);
    if ((u & 0x7FFFFFFFU) > 0x7F800000U)
    {
        return kBf16CanonicalNaN;
    }
    uint32_t const roundingBias = 0x7FFFU + ((u >> 16) & 1U);
    return static_cast<uint16_t>((u + roundingBias) >> 16);
#endif
}

// IEEE binary16, round to nearest even, subnormals kept, overflow -> inf, any NaN -> 0x7E00.
QKROPE_HD float fp16ToFloat(uint16_t h)
{
#if defined(__CUDA_ARCH__)
    return __half2float(__ushort_as_half(h));
#else
    uint32_t const sign = static_cast<uint32_t>(h & 0x8000U) << 16;
    uint32_t const exponent = (h >> 10) & 0x1FU;
    uint32_t const mantissa = h & 0x3FFU;
    if (exponent == 0)
    {
        // zero or subnormal: mantissa * 2^-24 is exact in fp32
        float const magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8F;
        return bitsFloat(floatBits(magnitude) | sign);
    }
    if (exponent == 0x1F)
    {
        return bitsFloat(sign | 0x7F800000U | (mantissa << 13));
    }
    return bitsFloat(sign | ((exponent + 112U) << 23) | (mantissa << 13));
#endif
}

QKROPE_HD uint16_t floatToFp16(float f)
{
#if defined(__CUDA_ARCH__)
    if (f != f)
    {
        return kFp16CanonicalNaN; // the hardware conversion would give 0x7FFF
    }
    return __half_as_ushort(__float2half_rn(f));
#else
    uint32_t u = floatBits(f);
    uint32_t const sign = (u >> 16) & 0x8000U;
    u &= 0x7FFFFFFFU;
    uint16_t out;
    if (u > 0x7F800000U)
    {
        return kFp16CanonicalNaN; // sign and payload dropped, as on the device (and for bf16)
    }
    if (u >= 0x47800000U) // |f| >= 2^16 (or inf): inf in fp16
    {
        out = 0x7C00U;
    }
    else if (u < 0x38800000U) // |f| < 2^-14: fp16 subnormal or zero
    {
        // Adding 0.5 aligns the value's bits so that the fp32 adder's own round-to-nearest-even
        // produces the fp16 subnormal mantissa in the low bits (exact for this range).
        float const aligned = bitsFloat(u) + 0.5F;
        out = static_cast<uint16_t>(floatBits(aligned) - 0x3F000000U);
    }
    else
    {
        uint32_t const mantissaOdd = (u >> 13) & 1U;
        u += 0xC8000FFFU; // rebias the exponent (-112 << 23) and add the rounding bias
        u += mantissaOdd;
        out = static_cast<uint16_t>(u >> 13); // a carry into exponent 31 gives inf, as it must
    }
    return static_cast<uint16_t>(out | sign);
#endif
}

// ---------------------------------------------------------------------------------------------
// Element types: Storage is the raw bit pattern in memory.
struct Fp32
{
    using Storage = float;
    static constexpr bool kIsFloat32 = true;
    QKROPE_HD static float toFloat(Storage v)
    {
        return v;
    }
    QKROPE_HD static Storage fromFloat(float v)
    {
        return v;
    }
};

struct Fp16
{
    using Storage = uint16_t;
    static constexpr bool kIsFloat32 = false;
    QKROPE_HD static float toFloat(Storage v)
    {
        return fp16ToFloat(v);
    }
    QKROPE_HD static Storage fromFloat(float v)
    {
        return floatToFp16(v);
    }
};

struct Bf16
{
    using Storage = uint16_t;
    static constexpr bool kIsFloat32 = false;
    QKROPE_HD static float toFloat(Storage v)
    {
        return bf16ToFloat(v);
    }
    QKROPE_HD static Storage fromFloat(float v)
    {
        return floatToBf16(v);
    }
};

// Round an fp32 value to the element type and back.
template <typename T>
QKROPE_HD float roundTo(float v)
{
    return T::toFloat(T::fromFloat(v));
}

// ---------------------------------------------------------------------------------------------
// The per-element pieces. Both the host row function and the CUDA kernels are built from these,
// so the only freedom an implementation has is the order of the sum of squares.

// The rounding modes (qkrope/contract.py ROUNDING_*; docs/spec.md section 3).
constexpr int32_t kRoundingOne = 0;       // one rounding, at the end
constexpr int32_t kRoundingDiffusers = 1; // diffusers' RMSNorm order (Qwen-Image)
constexpr int32_t kRoundingFlux = 2;      // torch's RMSNorm, then diffusers' fp32 rotation (FLUX)
constexpr int32_t kRoundingModes = 3;

// Normalised, weighted value (before rotation), as fp32.
template <typename T>
QKROPE_HD float normalize(float x, float inv, float w, int32_t rounding)
{
    if (!T::kIsFloat32)
    {
        if (rounding == kRoundingDiffusers)
        {
            return roundTo<T>(mul(roundTo<T>(mul(x, inv)), w));
        }
        if (rounding == kRoundingFlux)
        {
            return roundTo<T>(mul(mul(x, inv), w));
        }
    }
    return mul(mul(x, inv), w);
}

// Rotation of the pair (a, b) by (c, n) = (cos, sin): first = a*c - b*n, second = a*n + b*c.
QKROPE_HD float rotateFirst(float a, float b, float c, float n)
{
    return sub(mul(a, c), mul(b, n));
}

QKROPE_HD float rotateSecond(float a, float b, float c, float n)
{
    return add(mul(a, n), mul(b, c));
}

// ---------------------------------------------------------------------------------------------
// Sum of squares of one row in the order a kernel with `lanes` lanes and chunks of `vec`
// consecutive elements computes it (qknorm_rope_plan.h, SumLayout): chunk c belongs to lane
// c % lanes; each lane accumulates its chunks in increasing element order with fmaSquare; then
// for offset = lanes/2 .. 1 every lane adds the value of lane (lane ^ offset), own value first
// (a butterfly, as __shfl_xor_sync computes it). Every lane ends with the same sum. lanes is a
// power of two <= 32. Host-side model of the kernels' reduction.
template <typename T>
inline float sumSquares(typename T::Storage const* x, int headDim, int lanes, int vec)
{
    float partial[32];
    float next[32];
    for (int l = 0; l < lanes; ++l)
    {
        partial[l] = 0.0F;
    }
    for (int c = 0; c * vec < headDim; ++c)
    {
        int const l = c % lanes;
        for (int i = 0; i < vec && c * vec + i < headDim; ++i)
        {
            partial[l] = fmaSquare(T::toFloat(x[c * vec + i]), partial[l]);
        }
    }
    for (int offset = lanes / 2; offset > 0; offset /= 2)
    {
        for (int l = 0; l < lanes; ++l)
        {
            next[l] = add(partial[l], partial[l ^ offset]);
        }
        for (int l = 0; l < lanes; ++l)
        {
            partial[l] = next[l];
        }
    }
    return partial[0];
}

// The sum of squares of a token's whole q or k row (norm_scope 1: num_heads x head_dim values), in
// the order every kernel path computes it, independent of how many heads a thread owns (so the launch
// plan may pick any instance): each head's sum as sumSquares gives it for the path (lanes, vec); the
// head sums dealt round-robin to 32 lanes (head h to lane h % 32), each lane adding its own in
// increasing head order starting from +0 (an exact first step); then a butterfly over the 32 lanes,
// as __shfl_xor_sync computes it. Host-side model of the kernels' cross-head reduction.
inline void butterfly32(float (&partial)[32])
{
    float next[32];
    for (int offset = 16; offset > 0; offset /= 2)
    {
        for (int l = 0; l < 32; ++l)
        {
            next[l] = add(partial[l], partial[l ^ offset]);
        }
        for (int l = 0; l < 32; ++l)
        {
            partial[l] = next[l];
        }
    }
}

template <typename T>
inline float rowSumSquares(typename T::Storage const* x, int64_t numHeads, int headDim, int lanes, int vec)
{
    float partial[32];
    for (int l = 0; l < 32; ++l)
    {
        partial[l] = 0.0F;
    }
    for (int64_t h = 0; h < numHeads; ++h)
    {
        int const l = static_cast<int>(h % 32);
        partial[l] = add(partial[l], sumSquares<T>(x + h * headDim, headDim, lanes, vec));
    }
    butterfly32(partial);
    return partial[0];
}

// One head's row on one thread given its inverse RMS (host build): normalise with w, rotate, round.
//   x, out : headDim elements; w : headDim weights as fp32 (each the exact value of the weight in
//   its own dtype: the activations' or fp32); cacheRow : rotaryDim floats (cos half, then sin half).
// out may alias x.
template <typename T>
inline void normRopeRowInv(typename T::Storage const* x, float const* w, float const* cacheRow,
    typename T::Storage* out, int headDim, int rotaryDim, float inv, bool interleaved, int32_t rounding,
    float* scratch)
{
    for (int e = 0; e < headDim; ++e)
    {
        scratch[e] = normalize<T>(T::toFloat(x[e]), inv, w[e], rounding);
    }
    int const half = rotaryDim / 2;
    for (int j = 0; j < half; ++j)
    {
        int const ia = interleaved ? 2 * j : j;
        int const ib = interleaved ? 2 * j + 1 : j + half;
        float const a = scratch[ia];
        float const b = scratch[ib];
        float const c = cacheRow[j];
        float const n = cacheRow[half + j];
        out[ia] = T::fromFloat(rotateFirst(a, b, c, n));
        out[ib] = T::fromFloat(rotateSecond(a, b, c, n));
    }
    for (int e = rotaryDim; e < headDim; ++e)
    {
        out[e] = T::fromFloat(scratch[e]);
    }
}

// One whole row on one thread (host build), with the sum of squares in the order of the kernel
// path that the launcher takes for the same problem (lanes, vec: see sumSquares).
template <typename T>
inline void normRopeRow(typename T::Storage const* x, float const* w, float const* cacheRow,
    typename T::Storage* out, int headDim, int rotaryDim, float eps, bool interleaved, int32_t rounding, int lanes,
    int vec, float* scratch)
{
    float const inv = rmsInv(sumSquares<T>(x, headDim, lanes, vec), headDim, eps);
    normRopeRowInv<T>(x, w, cacheRow, out, headDim, rotaryDim, inv, interleaved, rounding, scratch);
}

} // namespace math
} // namespace qkrope
