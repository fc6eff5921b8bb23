// qkrope: the per-row arithmetic of QKNormRoPE (spec section 3), shared by the CUDA kernel and
// the host-only CPU build used by the tests. Everything here is __host__ __device__ and compiles
// with plain g++ (no CUDA headers) as well as with nvcc.
//
// Numerics (chosen so that the host build, the CUDA kernel and the PyTorch reference agree):
//   - all maths in fp32; every multiply/add is an explicit, separately rounded IEEE operation
//     (no FMA contraction: on the device through __fmul_rn/__fadd_rn/__fsub_rn, on the host by
//     building with -ffp-contract=off), in the same order as export/reference.py;
//   - inv = 1 / sqrt(sum(x^2) / D + eps), correctly rounded sqrt and division (what torch.rsqrt
//     computes on the CPU); the sum of squares is the only place where the summation order
//     differs from torch (see sumOfSquares below);
//   - fp16/bf16 <-> fp32 conversions round to nearest even, bit-exact with torch's (NaN -> the
//     canonical quiet NaN, overflow -> inf).
//   - rounding = 0: y = (x * inv) * w in fp32, rotate in fp32, round once.
//     rounding = 1: y = round(round(x * inv) * w) (diffusers' RMSNorm order), rotate in fp32,
//     round once. With fp32 activations both modes are the same computation.
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

// 1 / sqrt(meanSq + eps) with meanSq = sumSq / D: IEEE division, IEEE sqrt, IEEE division.
QKROPE_HD float rmsInv(float sumSq, int headDim, float eps)
{
#if defined(__CUDA_ARCH__)
    float const meanSq = __fdiv_rn(sumSq, static_cast<float>(headDim));
    return __fdiv_rn(1.0F, __fsqrt_rn(__fadd_rn(meanSq, eps)));
#else
    float const meanSq = sumSq / static_cast<float>(headDim);
    return 1.0F / std::sqrt(meanSq + eps);
#endif
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

// bfloat16: the upper 16 bits of an fp32, round to nearest even; NaN -> 0x7FC0 (as torch).
QKROPE_HD float bf16ToFloat(uint16_t h)
{
    return bitsFloat(static_cast<uint32_t>(h) << 16);
}

QKROPE_HD uint16_t floatToBf16(float f)
{
#if defined(__CUDA_ARCH__)
    if (f != f)
    {
        return 0x7FC0U;
    }
    return __bfloat16_as_ushort(__float2bfloat16_rn(f));
#else
    uint32_t const u = floatBits(f);
    if ((u & 0x7FFFFFFFU) > 0x7F800000U)
    {
        return 0x7FC0U;
    }
    uint32_t const roundingBias = 0x7FFFU + ((u >> 16) & 1U);
    return static_cast<uint16_t>((u + roundingBias) >> 16);
#endif
}

// IEEE binary16, round to nearest even, subnormals kept, overflow -> inf, NaN -> quiet NaN.
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
    return __half_as_ushort(__float2half_rn(f));
#else
    uint32_t u = floatBits(f);
    uint32_t const sign = (u >> 16) & 0x8000U;
    u &= 0x7FFFFFFFU;
    uint16_t out;
    if (u >= 0x47800000U) // |f| >= 2^16 (or inf / NaN): inf or NaN in fp16
    {
        out = (u > 0x7F800000U) ? 0x7E00U : 0x7C00U;
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

// Normalised, weighted value (before rotation), as fp32.
template <typename T>
QKROPE_HD float normalize(float x, float inv, float w, int32_t rounding)
{
    if (rounding == 1 && !T::kIsFloat32)
    {
        return roundTo<T>(mul(roundTo<T>(mul(x, inv)), w));
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
// One whole row on one thread (host build; the general CUDA path follows the same steps).
//   x, w, out : headDim elements; cacheRow : rotaryDim floats (cos half, then sin half).
// out may alias x. Sum of squares: sequential, in element order.
template <typename T>
QKROPE_HD void normRopeRow(typename T::Storage const* x, typename T::Storage const* w, float const* cacheRow,
    typename T::Storage* out, int headDim, int rotaryDim, float eps, bool interleaved, int32_t rounding, float* scratch)
{
    float sumSq = 0.0F;
    for (int e = 0; e < headDim; ++e)
    {
        float const v = T::toFloat(x[e]);
        scratch[e] = v;
        sumSq = add(sumSq, mul(v, v));
    }
    float const inv = rmsInv(sumSq, headDim, eps);
    for (int e = 0; e < headDim; ++e)
    {
        scratch[e] = normalize<T>(scratch[e], inv, T::toFloat(w[e]), rounding);
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

} // namespace math
} // namespace qkrope
