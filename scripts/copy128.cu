// The bandwidth yardstick of scripts/bandwidth_check.py: a plain 128-bit copy (grid-stride, one
// 16-byte load and one 16-byte store per element, several loads in flight per thread), built by
// scripts/gpu_check.sh into libqkrope_copy128.so. It moves what the fused kernel moves (its reads
// and writes as one stream), so kernel time / copy time is the fraction of achievable bandwidth.
#include <cuda_runtime.h>

#include <cstdint>

namespace
{

constexpr int kThreads = 256;
constexpr int kUnroll = 4; // independent 16-byte loads in flight per thread per iteration

__global__ void __launch_bounds__(kThreads) copy128(uint4 const* __restrict__ src, uint4* __restrict__ dst, int64_t n)
{
    int64_t const stride = static_cast<int64_t>(gridDim.x) * kThreads;
    int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
    for (; i + (kUnroll - 1) * stride < n; i += kUnroll * stride)
    {
        uint4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
        {
            v[u] = __ldcs(src + i + u * stride);
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
        {
            dst[i + u * stride] = v[u];
        }
    }
    for (; i < n; i += stride)
    {
        dst[i] = __ldcs(src + i);
    }
}

} // namespace

// Copies n16 16-byte chunks (both pointers 16-byte aligned) on `stream`; returns the cudaError_t.
extern "C" __attribute__((visibility("default"))) int32_t qkrope_copy128(void const* src, void* dst, int64_t n16,
    void* stream)
{
    int device = 0;
    int sms = 1;
    int perSm = 1;
    cudaGetDevice(&device);
    cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&perSm, copy128, kThreads, 0);
    int64_t const need = (n16 + kThreads - 1) / kThreads;
    int64_t const resident = static_cast<int64_t>(sms) * (perSm > 0 ? perSm : 1);
    unsigned const blocks = static_cast<unsigned>(need < resident ? (need > 0 ? need : 1) : resident);
    copy128<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<uint4 const*>(src), static_cast<uint4*>(dst), n16);
    return static_cast<int32_t>(cudaGetLastError());
}
