// qkrope SIMT emulation: stand-in for <cuda_runtime.h> when CUDA sources are compiled as C++ with
// g++ (simt_add_emulated_library in SimtEmulation.cmake puts this directory first on the include
// path and defines __CUDACC__ and __CUDA_ARCH__=900, so device-only branches of the sources are the
// ones compiled).
//
// Emulates: the function qualifiers (__global__, __device__, __host__, __forceinline__,
// __noinline__, __launch_bounds__, __shared__ as static thread_local, __align__, __constant__),
// threadIdx/blockIdx/blockDim/gridDim/warpSize, vector types with make_*, warp intrinsics
// (__shfl_sync/_up/_down/_xor with CUDA's width semantics, __syncwarp, __syncthreads[_count/_and/
// _or], __activemask, __ballot_sync, __any_sync, __all_sync, __match_any/all_sync, __reduce_*_sync)
// as real barriers between fibers (simt.h), the cache-hint load/store intrinsics (__ldg, __ldcs,
// __ldcg, __ldca, __ldlu, __ldcv, __stcs, __stcg, __stwb, __stwt: plain accesses plus an alignment
// check), the correctly rounded fp32 intrinsics (__fadd_rn, __fmul_rn, __fmaf_rn = a true fused
// multiply-add, __fdiv_rn, __fsqrt_rn, __frcp_rn, __frsqrt_rn, ...) with the device's canonical
// NaN (0x7FFFFFFF) for NaN results, bit casts, a few integer intrinsics, atomics (trivially atomic:
// the fibers of a launch never run in parallel), and the runtime API a launcher needs: errors,
// devices and attributes, occupancy, cudaFuncGetAttributes, typed cudaLaunchKernel, memory
// functions on host memory, synchronous streams.
//
// Does not emulate: see simt.h (no memory model beyond program order between sync points, no
// timing, no dynamic shared memory, no <<<>>> syntax: launch through cudaLaunchKernel or
// SIMT_LAUNCH). The approximate intrinsics (__expf, __sinf, ...) use the correctly rounded or
// libm functions, not the hardware approximations.
#pragma once

// Standard headers that use __noinline__ / __launch_bounds__-like names in attributes are
// included before the macros below exist (libstdc++'s shared_ptr_base.h spells
// __attribute__((__noinline__))).
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <new>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "simt.h"

// ---- qualifiers ----------------------------------------------------------------------------------
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __shared__ static thread_local
#define __constant__
#define __managed__
#define __grid_constant__
#define __align__(n) __attribute__((aligned(n)))
#define __cudart_builtin__
#ifndef CUDART_VERSION
#define CUDART_VERSION 13000
#endif

// ---- fp32 intrinsics -----------------------------------------------------------------------------
namespace simt
{
namespace detail
{
inline uint32_t bitsOf(float f)
{
    uint32_t u;
    std::memcpy(&u, &f, sizeof(u));
    return u;
}
inline float floatOf(uint32_t u)
{
    float f;
    std::memcpy(&f, &u, sizeof(f));
    return f;
}
// NVIDIA GPUs return the canonical NaN 0x7FFFFFFF for an fp32 arithmetic result that is NaN
// (no payload propagation; to our knowledge -- not checked on hardware here); x86 propagates
// payloads, so results are canonicalised here. Only the intrinsics below do this: plain a * b in
// kernel code keeps the host's NaN.
inline float canon(float r)
{
    return r != r ? floatOf(0x7FFFFFFFU) : r;
}
float rsqrtCorrectlyRounded(float x);
} // namespace detail
} // namespace simt

inline float __fadd_rn(float a, float b)
{
    return simt::detail::canon(a + b);
}
inline float __fsub_rn(float a, float b)
{
    return simt::detail::canon(a - b);
}
inline float __fmul_rn(float a, float b)
{
    return simt::detail::canon(a * b);
}
inline float __fmaf_rn(float a, float b, float c)
{
    return simt::detail::canon(std::fma(a, b, c));
}
inline float __fdiv_rn(float a, float b)
{
    return simt::detail::canon(a / b);
}
inline float __fsqrt_rn(float a)
{
    return simt::detail::canon(std::sqrt(a));
}
inline float __frcp_rn(float a)
{
    return simt::detail::canon(1.0F / a);
}
inline float __frsqrt_rn(float a)
{
    return simt::detail::rsqrtCorrectlyRounded(a);
}
inline float __fdividef(float a, float b)
{
    return __fdiv_rn(a, b);
}
inline float __saturatef(float a)
{
    return a != a ? 0.0F : (a < 0.0F ? 0.0F : (a > 1.0F ? 1.0F : a));
}
inline float rsqrtf(float a)
{
    return __frsqrt_rn(a);
}
inline float __expf(float a)
{
    return std::exp(a);
}
inline float __logf(float a)
{
    return std::log(a);
}
inline float __sinf(float a)
{
    return std::sin(a);
}
inline float __cosf(float a)
{
    return std::cos(a);
}
inline float __powf(float a, float b)
{
    return std::pow(a, b);
}
inline double __dadd_rn(double a, double b)
{
    return a + b;
}
inline double __dmul_rn(double a, double b)
{
    return a * b;
}
inline double __fma_rn(double a, double b, double c)
{
    return std::fma(a, b, c);
}

inline unsigned int __float_as_uint(float f)
{
    return simt::detail::bitsOf(f);
}
inline float __uint_as_float(unsigned int u)
{
    return simt::detail::floatOf(u);
}
inline int __float_as_int(float f)
{
    return static_cast<int>(simt::detail::bitsOf(f));
}
inline float __int_as_float(int i)
{
    return simt::detail::floatOf(static_cast<uint32_t>(i));
}
inline long long __double_as_longlong(double d)
{
    long long v;
    std::memcpy(&v, &d, sizeof(v));
    return v;
}
inline double __longlong_as_double(long long v)
{
    double d;
    std::memcpy(&d, &v, sizeof(d));
    return d;
}

// min/max as CUDA's overload set (integers compare in the common type, floating point as fminf).
template <class A, class B,
    class = std::enable_if_t<std::is_arithmetic<A>::value && std::is_arithmetic<B>::value>>
inline std::common_type_t<A, B> min(A a, B b)
{
    using C = std::common_type_t<A, B>;
    if constexpr (std::is_floating_point<C>::value)
        return std::fmin(static_cast<C>(a), static_cast<C>(b));
    else
        return static_cast<C>(a) < static_cast<C>(b) ? static_cast<C>(a) : static_cast<C>(b);
}
template <class A, class B,
    class = std::enable_if_t<std::is_arithmetic<A>::value && std::is_arithmetic<B>::value>>
inline std::common_type_t<A, B> max(A a, B b)
{
    using C = std::common_type_t<A, B>;
    if constexpr (std::is_floating_point<C>::value)
        return std::fmax(static_cast<C>(a), static_cast<C>(b));
    else
        return static_cast<C>(a) < static_cast<C>(b) ? static_cast<C>(b) : static_cast<C>(a);
}
inline unsigned int umin(unsigned int a, unsigned int b)
{
    return a < b ? a : b;
}
inline unsigned int umax(unsigned int a, unsigned int b)
{
    return a < b ? b : a;
}

// ---- integer intrinsics --------------------------------------------------------------------------
inline int __popc(unsigned int x)
{
    return __builtin_popcount(x);
}
inline int __popcll(unsigned long long x)
{
    return __builtin_popcountll(x);
}
inline int __clz(int x)
{
    return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x));
}
inline int __clzll(long long x)
{
    return x == 0 ? 64 : __builtin_clzll(static_cast<unsigned long long>(x));
}
inline int __ffs(int x)
{
    return __builtin_ffs(x);
}
inline int __ffsll(long long x)
{
    return __builtin_ffsll(x);
}
inline unsigned int __brev(unsigned int x)
{
    unsigned int r = 0;
    for (int i = 0; i < 32; ++i)
    {
        r |= ((x >> i) & 1U) << (31 - i);
    }
    return r;
}
inline unsigned int __umulhi(unsigned int a, unsigned int b)
{
    return static_cast<unsigned int>((static_cast<unsigned long long>(a) * b) >> 32);
}
inline int __mulhi(int a, int b)
{
    return static_cast<int>((static_cast<long long>(a) * b) >> 32);
}

// ---- block and warp synchronisation ------------------------------------------------------------
inline void __syncthreads(simt::detail::Loc loc = SIMT_HERE)
{
    simt::detail::syncThreads(loc);
}
inline void __syncwarp(unsigned mask = 0xFFFFFFFFU, simt::detail::Loc loc = SIMT_HERE)
{
    (void) simt::detail::collective(simt::detail::Op::SyncWarp, mask, 0, 0, 32, 0, loc);
}
inline unsigned __activemask()
{
    return simt::detail::activeMask();
}
inline void __threadfence()
{
    std::atomic_thread_fence(std::memory_order_seq_cst);
}
inline void __threadfence_block()
{
    std::atomic_thread_fence(std::memory_order_seq_cst);
}
inline void __threadfence_system()
{
    std::atomic_thread_fence(std::memory_order_seq_cst);
}

inline unsigned __ballot_sync(unsigned mask, int pred, simt::detail::Loc loc = SIMT_HERE)
{
    return static_cast<unsigned>(
        simt::detail::collective(simt::detail::Op::Ballot, mask, pred != 0 ? 1U : 0U, 0, 32, 4, loc));
}
inline int __any_sync(unsigned mask, int pred, simt::detail::Loc loc = SIMT_HERE)
{
    return static_cast<int>(simt::detail::collective(simt::detail::Op::Any, mask, pred != 0 ? 1U : 0U, 0, 32, 4, loc));
}
inline int __all_sync(unsigned mask, int pred, simt::detail::Loc loc = SIMT_HERE)
{
    return static_cast<int>(simt::detail::collective(simt::detail::Op::All, mask, pred != 0 ? 1U : 0U, 0, 32, 4, loc));
}
inline int __syncthreads_count(int pred, simt::detail::Loc loc = SIMT_HERE);
inline int __syncthreads_and(int pred, simt::detail::Loc loc = SIMT_HERE);
inline int __syncthreads_or(int pred, simt::detail::Loc loc = SIMT_HERE);

namespace simt
{
namespace detail
{
template <class T>
inline uint64_t toBits(T v)
{
    static_assert(std::is_trivially_copyable<T>::value && sizeof(T) <= 8, "a 1..8-byte trivially copyable value");
    uint64_t u = 0;
    std::memcpy(&u, &v, sizeof(T));
    return u;
}
template <class T>
inline T fromBits(uint64_t u)
{
    T v;
    std::memcpy(&v, &u, sizeof(T));
    return v;
}
template <class T>
inline T shfl(Op op, unsigned mask, T var, int arg, int width, Loc loc)
{
    return fromBits<T>(collective(op, mask, toBits(var), arg, width, static_cast<int>(sizeof(T)), loc));
}
} // namespace detail
} // namespace simt

// The shuffles, for CUDA's overload set (an int, unsigned, long, long long, float or double; the
// fp16/bf16 headers add theirs). width: a power of two in [1, 32], lanes split into segments.
#define SIMT_SHFL_OVERLOADS(T)                                                                      \
    inline T __shfl_sync(unsigned mask, T var, int srcLane, int width = warpSize,                   \
        simt::detail::Loc loc = SIMT_HERE)                                                          \
    {                                                                                               \
        return simt::detail::shfl(simt::detail::Op::ShflIdx, mask, var, srcLane, width, loc);      \
    }                                                                                               \
    inline T __shfl_up_sync(unsigned mask, T var, unsigned int delta, int width = warpSize,         \
        simt::detail::Loc loc = SIMT_HERE)                                                          \
    {                                                                                               \
        return simt::detail::shfl(simt::detail::Op::ShflUp, mask, var, static_cast<int>(delta), width, loc); \
    }                                                                                               \
    inline T __shfl_down_sync(unsigned mask, T var, unsigned int delta, int width = warpSize,       \
        simt::detail::Loc loc = SIMT_HERE)                                                          \
    {                                                                                               \
        return simt::detail::shfl(simt::detail::Op::ShflDown, mask, var, static_cast<int>(delta), width, loc); \
    }                                                                                               \
    inline T __shfl_xor_sync(unsigned mask, T var, int laneMask, int width = warpSize,              \
        simt::detail::Loc loc = SIMT_HERE)                                                          \
    {                                                                                               \
        return simt::detail::shfl(simt::detail::Op::ShflXor, mask, var, laneMask, width, loc);     \
    }

SIMT_SHFL_OVERLOADS(int)
SIMT_SHFL_OVERLOADS(unsigned int)
SIMT_SHFL_OVERLOADS(long)
SIMT_SHFL_OVERLOADS(unsigned long)
SIMT_SHFL_OVERLOADS(long long)
SIMT_SHFL_OVERLOADS(unsigned long long)
SIMT_SHFL_OVERLOADS(float)
SIMT_SHFL_OVERLOADS(double)

#define SIMT_MATCH_OVERLOADS(T)                                                                     \
    inline unsigned __match_any_sync(unsigned mask, T value, simt::detail::Loc loc = SIMT_HERE)     \
    {                                                                                               \
        return static_cast<unsigned>(simt::detail::collective(simt::detail::Op::MatchAny, mask,     \
            simt::detail::toBits(value), 0, 32, static_cast<int>(sizeof(T)), loc));                \
    }                                                                                               \
    inline unsigned __match_all_sync(unsigned mask, T value, int* pred, simt::detail::Loc loc = SIMT_HERE) \
    {                                                                                               \
        return static_cast<unsigned>(simt::detail::collective(simt::detail::Op::MatchAll, mask,     \
            simt::detail::toBits(value), 0, 32, static_cast<int>(sizeof(T)), loc, pred));          \
    }
SIMT_MATCH_OVERLOADS(int)
SIMT_MATCH_OVERLOADS(unsigned int)
SIMT_MATCH_OVERLOADS(long)
SIMT_MATCH_OVERLOADS(unsigned long)
SIMT_MATCH_OVERLOADS(long long)
SIMT_MATCH_OVERLOADS(unsigned long long)
SIMT_MATCH_OVERLOADS(float)
SIMT_MATCH_OVERLOADS(double)
#undef SIMT_MATCH_OVERLOADS

#define SIMT_REDUCE(name, T, op)                                                                    \
    inline T name(unsigned mask, T value, simt::detail::Loc loc = SIMT_HERE)                        \
    {                                                                                               \
        return static_cast<T>(simt::detail::collective(simt::detail::Op::op, mask,                  \
            static_cast<uint32_t>(value), 0, 32, 4, loc));                                          \
    }
SIMT_REDUCE(__reduce_add_sync, unsigned, ReduceAddU)
SIMT_REDUCE(__reduce_min_sync, unsigned, ReduceMinU)
SIMT_REDUCE(__reduce_max_sync, unsigned, ReduceMaxU)
SIMT_REDUCE(__reduce_add_sync, int, ReduceAddS)
SIMT_REDUCE(__reduce_min_sync, int, ReduceMinS)
SIMT_REDUCE(__reduce_max_sync, int, ReduceMaxS)
SIMT_REDUCE(__reduce_and_sync, unsigned, ReduceAnd)
SIMT_REDUCE(__reduce_or_sync, unsigned, ReduceOr)
SIMT_REDUCE(__reduce_xor_sync, unsigned, ReduceXor)
#undef SIMT_REDUCE

// ---- cache-hint loads and stores: plain accesses, with the alignment the hardware requires -------
template <class T>
struct simt_identity
{
    using type = T;
};
#define SIMT_LOAD(name)                                                                             \
    template <class T>                                                                              \
    inline T name(T const* p, simt::detail::Loc loc = SIMT_HERE)                                    \
    {                                                                                               \
        simt::detail::checkAligned(p, alignof(T), #name, loc);                                      \
        return *p;                                                                                  \
    }
#define SIMT_STORE(name)                                                                            \
    template <class T>                                                                              \
    inline void name(T* p, typename simt_identity<T>::type v, simt::detail::Loc loc = SIMT_HERE)   \
    {                                                                                               \
        simt::detail::checkAligned(p, alignof(T), #name, loc);                                      \
        *p = v;                                                                                     \
    }
SIMT_LOAD(__ldg)
SIMT_LOAD(__ldcs)
SIMT_LOAD(__ldcg)
SIMT_LOAD(__ldca)
SIMT_LOAD(__ldlu)
SIMT_LOAD(__ldcv)
SIMT_STORE(__stcs)
SIMT_STORE(__stcg)
SIMT_STORE(__stwb)
SIMT_STORE(__stwt)
#undef SIMT_LOAD
#undef SIMT_STORE

// ---- atomics (fibers of a launch never run in parallel; launches on other OS threads must not
// ---- share the same memory, as separate CUDA contexts would not) -----------------------------------
template <class T>
inline T atomicAdd(T* p, T v)
{
    T old = *p;
    *p = static_cast<T>(old + v);
    return old;
}
template <class T>
inline T atomicSub(T* p, T v)
{
    T old = *p;
    *p = static_cast<T>(old - v);
    return old;
}
template <class T>
inline T atomicExch(T* p, T v)
{
    T old = *p;
    *p = v;
    return old;
}
template <class T>
inline T atomicMin(T* p, T v)
{
    T old = *p;
    *p = v < old ? v : old;
    return old;
}
template <class T>
inline T atomicMax(T* p, T v)
{
    T old = *p;
    *p = old < v ? v : old;
    return old;
}
template <class T>
inline T atomicCAS(T* p, T compare, T v)
{
    T old = *p;
    if (old == compare)
    {
        *p = v;
    }
    return old;
}
template <class T>
inline T atomicAnd(T* p, T v)
{
    T old = *p;
    *p = old & v;
    return old;
}
template <class T>
inline T atomicOr(T* p, T v)
{
    T old = *p;
    *p = old | v;
    return old;
}
template <class T>
inline T atomicXor(T* p, T v)
{
    T old = *p;
    *p = old ^ v;
    return old;
}

// ---- runtime API ----------------------------------------------------------------------------------
enum cudaDeviceAttr
{
    cudaDevAttrMaxThreadsPerBlock = 1,
    cudaDevAttrMaxBlockDimX = 2,
    cudaDevAttrMaxBlockDimY = 3,
    cudaDevAttrMaxBlockDimZ = 4,
    cudaDevAttrMaxGridDimX = 5,
    cudaDevAttrMaxGridDimY = 6,
    cudaDevAttrMaxGridDimZ = 7,
    cudaDevAttrMaxSharedMemoryPerBlock = 8,
    cudaDevAttrTotalConstantMemory = 9,
    cudaDevAttrWarpSize = 10,
    cudaDevAttrMaxRegistersPerBlock = 12,
    cudaDevAttrClockRate = 13,
    cudaDevAttrMultiProcessorCount = 16,
    cudaDevAttrConcurrentKernels = 31,
    cudaDevAttrMemoryClockRate = 36,
    cudaDevAttrGlobalMemoryBusWidth = 37,
    cudaDevAttrL2CacheSize = 38,
    cudaDevAttrMaxThreadsPerMultiProcessor = 39,
    cudaDevAttrComputeCapabilityMajor = 75,
    cudaDevAttrComputeCapabilityMinor = 76,
    cudaDevAttrMaxSharedMemoryPerMultiprocessor = 81,
    cudaDevAttrMaxRegistersPerMultiprocessor = 82,
    cudaDevAttrMaxSharedMemoryPerBlockOptin = 97,
    cudaDevAttrMaxBlocksPerMultiprocessor = 106,
};

enum cudaMemcpyKind
{
    cudaMemcpyHostToHost = 0,
    cudaMemcpyHostToDevice = 1,
    cudaMemcpyDeviceToHost = 2,
    cudaMemcpyDeviceToDevice = 3,
    cudaMemcpyDefault = 4
};

enum cudaFuncAttribute
{
    cudaFuncAttributeMaxDynamicSharedMemorySize = 8,
    cudaFuncAttributePreferredSharedMemoryCarveout = 9,
};

struct cudaFuncAttributes
{
    std::size_t sharedSizeBytes;
    std::size_t constSizeBytes;
    std::size_t localSizeBytes;
    int maxThreadsPerBlock;
    int numRegs;
    int ptxVersion;
    int binaryVersion;
    int cacheModeCA;
    int maxDynamicSharedSizeBytes;
    int preferredShmemCarveout;
};

struct cudaDeviceProp
{
    char name[256];
    std::size_t totalGlobalMem;
    std::size_t sharedMemPerBlock;
    int regsPerBlock;
    int warpSize;
    int maxThreadsPerBlock;
    int maxThreadsDim[3];
    int maxGridSize[3];
    int major;
    int minor;
    int multiProcessorCount;
    int l2CacheSize;
    int maxThreadsPerMultiProcessor;
    std::size_t sharedMemPerMultiprocessor;
    int maxBlocksPerMultiProcessor;
};

char const* cudaGetErrorString(cudaError_t error);
char const* cudaGetErrorName(cudaError_t error);
cudaError_t cudaGetLastError();
cudaError_t cudaPeekAtLastError();
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaGetDeviceCount(int* count);
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device);
cudaError_t cudaDeviceSynchronize();
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaMalloc(void** ptr, std::size_t bytes);
cudaError_t cudaFree(void* ptr);
cudaError_t cudaMemcpy(void* dst, void const* src, std::size_t bytes, cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void* dst, void const* src, std::size_t bytes, cudaMemcpyKind kind, cudaStream_t stream = nullptr);
cudaError_t cudaMemset(void* dst, int value, std::size_t bytes);
cudaError_t cudaMemsetAsync(void* dst, int value, std::size_t bytes, cudaStream_t stream = nullptr);

namespace simt
{
namespace detail
{
cudaError_t setLastError(cudaError_t e);
cudaError_t occupancy(void const* kernel, int* numBlocks, int blockSize, std::size_t smem);
} // namespace detail
} // namespace simt

template <class... P>
inline cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* numBlocks, void (*kernel)(P...), int blockSize,
    std::size_t dynamicSMemSize)
{
    simt::detail::noteOccupancyQuery(reinterpret_cast<void const*>(kernel), typeid(kernel).name());
    return simt::detail::occupancy(reinterpret_cast<void const*>(kernel), numBlocks, blockSize, dynamicSMemSize);
}
template <class... P>
inline cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(int* numBlocks, void (*kernel)(P...),
    int blockSize, std::size_t dynamicSMemSize, unsigned int /*flags*/)
{
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(numBlocks, kernel, blockSize, dynamicSMemSize);
}
template <class... P>
inline cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* attr, void (*/*kernel*/)(P...))
{
    if (attr == nullptr)
    {
        return simt::detail::setLastError(cudaErrorInvalidValue);
    }
    *attr = cudaFuncAttributes{};
    attr->maxThreadsPerBlock = 1024;
    attr->numRegs = 32;
    attr->ptxVersion = 90;
    attr->binaryVersion = 90;
    return cudaSuccess;
}
template <class... P>
inline cudaError_t cudaFuncSetAttribute(void (*/*kernel*/)(P...), cudaFuncAttribute /*attr*/, int /*value*/)
{
    return cudaSuccess;
}

// The typed launch: args[i] points at an object of the kernel's i-th parameter type.
template <class... P>
inline cudaError_t cudaLaunchKernel(void (*kernel)(P...), dim3 gridDim_, dim3 blockDim_, void** args,
    std::size_t sharedMem = 0, cudaStream_t stream = nullptr)
{
    return simt::detail::launchTyped(kernel, gridDim_, blockDim_, args, sharedMem, stream, std::index_sequence_for<P...>{});
}
// The untyped C form cannot be emulated (the parameter types are unknown).
inline cudaError_t cudaLaunchKernel(void const* /*func*/, dim3, dim3, void**, std::size_t = 0, cudaStream_t = nullptr)
{
    return simt::detail::setLastError(cudaErrorInvalidDeviceFunction);
}

inline int __syncthreads_count(int pred, simt::detail::Loc loc)
{
    // a block-wide count needs block-shared storage: two barriers around a per-block counter
    static thread_local int counter = 0;
    __syncthreads(loc);
    if (threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0)
    {
        counter = 0;
    }
    __syncthreads(loc);
    if (pred != 0)
    {
        ++counter;
    }
    __syncthreads(loc);
    int const result = counter;
    __syncthreads(loc);
    return result;
}
inline int __syncthreads_and(int pred, simt::detail::Loc loc)
{
    return __syncthreads_count(pred != 0 ? 0 : 1, loc) == 0 ? 1 : 0;
}
inline int __syncthreads_or(int pred, simt::detail::Loc loc)
{
    return __syncthreads_count(pred, loc) != 0 ? 1 : 0;
}
