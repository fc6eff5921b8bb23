// qkrope SIMT emulation: stand-in for <cuda_fp16.h> (see simt.h and cuda_runtime.h).
//
// Emulates: __half / __half2 (2 and 4 bytes, raw bits in __x), the fp32 <-> fp16 conversions with
// the device's rules: round to nearest even, subnormals kept, overflow to +-inf, and a NaN input
// converts to the canonical NaN 0x7FFF (sign dropped) that cvt.rn.f16.f32 produces; fp16 -> fp32
// is exact and a NaN converts to 0x7FFFFFFF. Source for the NaN rule: NVIDIA's own cuda_fp16.hpp
// software conversion (__internal_float2half: "NaN/+Inf/-Inf ... result = 0x7fffU"), which mirrors
// the hardware; torch's CPU conversion gives 0x7E00 instead, and the tests can see the difference.
// Also __half2float, __floats2half2_rn, __float22half2_rn, __half22float2, __low2float,
// __high2float, __half_as_ushort, __ushort_as_half, __hisnan, __hisinf, __shfl*_sync for __half
// and __half2.
//
// Does not emulate: half arithmetic operators and intrinsics (__hadd, __hmul, ...): convert to
// float and use the fp32 intrinsics.
#pragma once

#include "cuda_runtime.h"

struct __half_raw
{
    unsigned short x;
};

namespace simt
{
namespace detail
{
// fp32 -> fp16 bits, round to nearest even (the device's cvt.rn.f16.f32).
inline unsigned short floatToHalfBits(float f)
{
    uint32_t const x = bitsOf(f);
    uint32_t const sign = (x >> 16) & 0x8000U;
    uint32_t const u = x & 0x7FFFFFFFU;
    if (u > 0x7F800000U)
    {
        return 0x7FFFU; // NaN: canonical, sign dropped
    }
    if (u >= 0x477FF000U) // >= 65520 (the midpoint above 65504, ties to even = up): inf
    {
        return static_cast<unsigned short>(sign | 0x7C00U);
    }
    if (u >= 0x38800000U) // normal fp16 (>= 2^-14)
    {
        uint32_t r = u - 0x38000000U; // rebias: exponent - 112
        r += 0xFFFU + ((r >> 13) & 1U);
        return static_cast<unsigned short>(sign | (r >> 13));
    }
    if (u <= 0x33000000U) // <= 2^-25: rounds to zero (2^-25 itself is a tie, to even = 0)
    {
        return static_cast<unsigned short>(sign);
    }
    // subnormal fp16: m = round(|f| * 2^24), |f| = mant * 2^(e - 150)
    uint32_t const e = u >> 23;
    uint32_t const mant = (u & 0x7FFFFFU) | 0x800000U;
    uint32_t const shift = 126U - e; // 14..24
    uint32_t m = mant >> shift;
    uint32_t const rem = mant & ((1U << shift) - 1U);
    uint32_t const halfway = 1U << (shift - 1U);
    if (rem > halfway || (rem == halfway && (m & 1U) != 0))
    {
        ++m;
    }
    return static_cast<unsigned short>(sign | m);
}

inline float halfBitsToFloat(unsigned short h)
{
    uint32_t const sign = static_cast<uint32_t>(h & 0x8000U) << 16;
    uint32_t const exponent = (h >> 10) & 0x1FU;
    uint32_t const mantissa = h & 0x3FFU;
    if (exponent == 0x1F)
    {
        return mantissa != 0 ? floatOf(0x7FFFFFFFU) : floatOf(sign | 0x7F800000U);
    }
    if (exponent == 0)
    {
        float const magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8F; // exact
        return floatOf(bitsOf(magnitude) | sign);
    }
    return floatOf(sign | ((exponent + 112U) << 23) | (mantissa << 13));
}
} // namespace detail
} // namespace simt

struct __attribute__((aligned(2))) __half
{
    unsigned short __x;
    __half() = default;
    constexpr __half(__half_raw r) : __x(r.x) {}
    __half(float f) : __x(simt::detail::floatToHalfBits(f)) {}
    __half(double d) : __x(simt::detail::floatToHalfBits(static_cast<float>(d))) {}
    operator float() const
    {
        return simt::detail::halfBitsToFloat(__x);
    }
    operator __half_raw() const
    {
        return __half_raw{__x};
    }
};

struct __attribute__((aligned(4))) __half2
{
    __half x;
    __half y;
};

typedef __half half;
typedef __half2 half2;

inline __half __ushort_as_half(unsigned short u)
{
    return __half(__half_raw{u});
}
inline unsigned short __half_as_ushort(__half h)
{
    return h.__x;
}
inline short __half_as_short(__half h)
{
    return static_cast<short>(h.__x);
}
inline __half __float2half_rn(float f)
{
    return __ushort_as_half(simt::detail::floatToHalfBits(f));
}
inline __half __float2half(float f)
{
    return __float2half_rn(f);
}
inline float __half2float(__half h)
{
    return simt::detail::halfBitsToFloat(h.__x);
}
inline __half2 __floats2half2_rn(float a, float b)
{
    return __half2{__float2half_rn(a), __float2half_rn(b)};
}
inline __half2 __float22half2_rn(float2 v)
{
    return __floats2half2_rn(v.x, v.y);
}
inline __half2 __float2half2_rn(float a)
{
    return __floats2half2_rn(a, a);
}
inline float2 __half22float2(__half2 v)
{
    return make_float2(__half2float(v.x), __half2float(v.y));
}
inline float __low2float(__half2 v)
{
    return __half2float(v.x);
}
inline float __high2float(__half2 v)
{
    return __half2float(v.y);
}
inline __half __low2half(__half2 v)
{
    return v.x;
}
inline __half __high2half(__half2 v)
{
    return v.y;
}
inline __half2 __halves2half2(__half a, __half b)
{
    return __half2{a, b};
}
inline __half2 __half2half2(__half a)
{
    return __half2{a, a};
}
inline bool __hisnan(__half h)
{
    return (h.__x & 0x7FFFU) > 0x7C00U;
}
inline int __hisinf(__half h)
{
    return h.__x == 0x7C00U ? 1 : (h.__x == 0xFC00U ? -1 : 0);
}
SIMT_SHFL_OVERLOADS(__half)
SIMT_SHFL_OVERLOADS(__half2)
