// qkrope SIMT emulation: stand-in for <cuda_bf16.h> (see simt.h and cuda_runtime.h).
//
// Emulates: __nv_bfloat16 / __nv_bfloat162 (raw bits in __x), the fp32 <-> bf16 conversions with
// the device's rules: round to nearest even, subnormals kept, overflow to +-inf, and a NaN input
// converts to the canonical NaN 0x7FFF (sign dropped) that cvt.rn.bf16.f32 produces on sm_80+.
// Source for the NaN rule: NVIDIA's own cuda_bf16.hpp software conversion
// (__internal_float2bfloat16: "if ((x & 0x7fffffffU) > 0x7f800000U) ... return 0x7fffU"), the
// path used where the instruction is absent and which matches it; torch's CPU conversion gives
// 0x7FC0 instead, and the tests can see the difference. bf16 -> fp32 is the exact 16-bit shift.
// Also __float2bfloat16[_rn], __floats2bfloat162_rn, __float22bfloat162_rn, __bfloat162float,
// __bfloat1622float2, __low2float, __high2float, __bfloat16_as_ushort, __ushort_as_bfloat16,
// __hisnan, __hisinf, __shfl*_sync for __nv_bfloat16 and __nv_bfloat162.
//
// Does not emulate: bf16 arithmetic operators and intrinsics (__hadd, __hmul, ...).
#pragma once

#include "cuda_fp16.h"
#include "cuda_runtime.h"

struct __nv_bfloat16_raw
{
    unsigned short x;
};

namespace simt
{
namespace detail
{
inline unsigned short floatToBf16Bits(float f)
{
    uint32_t const x = bitsOf(f);
    if ((x & 0x7FFFFFFFU) > 0x7F800000U)
    {
        return 0x7FFFU; // NaN: canonical, sign dropped
    }
    return static_cast<unsigned short>((x + 0x7FFFU + ((x >> 16) & 1U)) >> 16);
}
inline float bf16BitsToFloat(unsigned short h)
{
    return floatOf(static_cast<uint32_t>(h) << 16);
}
} // namespace detail
} // namespace simt

struct __attribute__((aligned(2))) __nv_bfloat16
{
    unsigned short __x;
    __nv_bfloat16() = default;
    constexpr __nv_bfloat16(__nv_bfloat16_raw r) : __x(r.x) {}
    __nv_bfloat16(float f) : __x(simt::detail::floatToBf16Bits(f)) {}
    __nv_bfloat16(double d) : __x(simt::detail::floatToBf16Bits(static_cast<float>(d))) {}
    operator float() const
    {
        return simt::detail::bf16BitsToFloat(__x);
    }
    operator __nv_bfloat16_raw() const
    {
        return __nv_bfloat16_raw{__x};
    }
};

struct __attribute__((aligned(4))) __nv_bfloat162
{
    __nv_bfloat16 x;
    __nv_bfloat16 y;
};

typedef __nv_bfloat16 nv_bfloat16;
typedef __nv_bfloat162 nv_bfloat162;

inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u)
{
    return __nv_bfloat16(__nv_bfloat16_raw{u});
}
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h)
{
    return h.__x;
}
inline short __bfloat16_as_short(__nv_bfloat16 h)
{
    return static_cast<short>(h.__x);
}
inline __nv_bfloat16 __float2bfloat16_rn(float f)
{
    return __ushort_as_bfloat16(simt::detail::floatToBf16Bits(f));
}
inline __nv_bfloat16 __float2bfloat16(float f)
{
    return __float2bfloat16_rn(f);
}
inline float __bfloat162float(__nv_bfloat16 h)
{
    return simt::detail::bf16BitsToFloat(h.__x);
}
inline __nv_bfloat162 __floats2bfloat162_rn(float a, float b)
{
    return __nv_bfloat162{__float2bfloat16_rn(a), __float2bfloat16_rn(b)};
}
inline __nv_bfloat162 __float22bfloat162_rn(float2 v)
{
    return __floats2bfloat162_rn(v.x, v.y);
}
inline __nv_bfloat162 __float2bfloat162_rn(float a)
{
    return __floats2bfloat162_rn(a, a);
}
inline float2 __bfloat1622float2(__nv_bfloat162 v)
{
    return make_float2(__bfloat162float(v.x), __bfloat162float(v.y));
}
inline float __low2float(__nv_bfloat162 v)
{
    return __bfloat162float(v.x);
}
inline float __high2float(__nv_bfloat162 v)
{
    return __bfloat162float(v.y);
}
inline __nv_bfloat16 __low2bfloat16(__nv_bfloat162 v)
{
    return v.x;
}
inline __nv_bfloat16 __high2bfloat16(__nv_bfloat162 v)
{
    return v.y;
}
inline __nv_bfloat162 __halves2bfloat162(__nv_bfloat16 a, __nv_bfloat16 b)
{
    return __nv_bfloat162{a, b};
}
inline __nv_bfloat162 __bfloat162bfloat162(__nv_bfloat16 a)
{
    return __nv_bfloat162{a, a};
}
inline bool __hisnan(__nv_bfloat16 h)
{
    return (h.__x & 0x7FFFU) > 0x7F80U;
}
inline int __hisinf(__nv_bfloat16 h)
{
    return h.__x == 0x7F80U ? 1 : (h.__x == 0xFF80U ? -1 : 0);
}
SIMT_SHFL_OVERLOADS(__nv_bfloat16)
SIMT_SHFL_OVERLOADS(__nv_bfloat162)
