// qkrope: which kernel path a QKNormRoPE problem takes, and the sum-of-squares order of that path.
// Host-only and CUDA-free: the CUDA launcher (qknorm_rope.cu) decides with these functions, and so
// does the CPU build (qknorm_rope_host.cpp), which is how the two agree bit for bit.
//
//   fast path    head_dim 64/128/256, q, k, q_out, k_out and the cache 16-byte aligned, a rotary
//                half that is a multiple of 4 (cos/sin read as 16-byte vectors), and for NeoX pairing a
//                rotary half that is a whole number of 128-bit chunks (and, with two chunks per
//                thread, rotary_dim == head_dim): a group of `fastLanes` threads owns one row,
//                each thread 128-bit chunks of it;
//   general path everything else (any even head_dim <= 512, any alignment): a warp owns a row,
//                each lane element pairs p = lane, lane + 32, ...
#pragma once

#include "qknorm_rope.h"

#include <cstdint>

// The chunk geometry is also used by the kernels at compile time.
#if defined(__CUDACC__)
#define QKROPE_PLAN_HD __host__ __device__
#else
#define QKROPE_PLAN_HD
#endif

namespace qkrope
{

// Summation order of a row's sum of squares (math::sumSquares models it): chunks of `vec`
// consecutive elements are dealt round-robin to `lanes` lanes; each lane sums its own in element
// order; a butterfly over the lanes adds them up.
struct SumLayout
{
    int lanes;
    int vec;
};

enum class KernelPath : int32_t
{
    kFast = 0,
    kGeneral = 1,
};

constexpr int kGeneralLanes = 32; // general path: one warp per row
constexpr int kGeneralVec = 2;    // ... each lane owning element pairs

QKROPE_PLAN_HD constexpr int elementBytes(DataType t)
{
    return t == DataType::kFLOAT32 ? 4 : 2;
}

// Fast path: elements per 128-bit chunk, threads per row (<= 32), chunks per thread.
QKROPE_PLAN_HD constexpr int fastVec(int elemBytes)
{
    return 16 / elemBytes;
}

QKROPE_PLAN_HD constexpr int fastLanes(int headDim, int elemBytes)
{
    return headDim / fastVec(elemBytes) < 32 ? headDim / fastVec(elemBytes) : 32;
}

QKROPE_PLAN_HD constexpr int fastChunksPerThread(int headDim, int elemBytes)
{
    return headDim / fastVec(elemBytes) / fastLanes(headDim, elemBytes);
}

inline bool aligned(void const* p, uintptr_t bytes)
{
    return (reinterpret_cast<uintptr_t>(p) % bytes) == 0;
}

// The path the launcher takes (parameters already accepted by checkParams). The weights need no
// alignment: each thread reads its weight elements once, with scalar loads.
inline KernelPath selectPath(QKNormRoPEParams const& p)
{
    if (p.headDim != 64 && p.headDim != 128 && p.headDim != 256)
    {
        return KernelPath::kGeneral;
    }
    if (!aligned(p.q, 16) || !aligned(p.k, 16) || !aligned(p.qOut, 16) || !aligned(p.kOut, 16))
    {
        return KernelPath::kGeneral;
    }
    if (!aligned(p.cache, 16) || (p.rotaryDim / 2) % 4 != 0)
    {
        return KernelPath::kGeneral; // cos/sin are read as 16-byte vectors
    }
    if (!p.interleaved)
    {
        int const bytes = elementBytes(p.dtype);
        int const half = static_cast<int>(p.rotaryDim / 2);
        if (half % fastVec(bytes) != 0)
        {
            return KernelPath::kGeneral; // a NeoX partner would sit inside another chunk
        }
        if (fastChunksPerThread(static_cast<int>(p.headDim), bytes) == 2 && p.rotaryDim != p.headDim)
        {
            return KernelPath::kGeneral; // two chunks per thread pair up only at full rotary
        }
    }
    return KernelPath::kFast;
}

inline SumLayout sumLayout(QKNormRoPEParams const& p)
{
    if (selectPath(p) == KernelPath::kFast)
    {
        int const bytes = elementBytes(p.dtype);
        return SumLayout{fastLanes(static_cast<int>(p.headDim), bytes), fastVec(bytes)};
    }
    return SumLayout{kGeneralLanes, kGeneralVec};
}

} // namespace qkrope
