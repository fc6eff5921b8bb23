// SIMT emulation: the CUDA runtime API that a launcher needs (cuda_runtime.h declares it): the
// calling thread's last error, devices and their attributes (the emulated devices of
// simt_state.cpp), occupancy, synchronous streams, memory functions on host memory; and the
// out-of-line part of the fp32 intrinsics (__frsqrt_rn).
#include "simt_internal.h"

#include <cstdio>

namespace simt
{
namespace internal
{

thread_local cudaError_t tlLastError = cudaSuccess;

} // namespace internal

namespace detail
{

using namespace internal;

void noteOccupancyQuery(void const* kernel, char const* signature)
{
    std::lock_guard<std::mutex> lock(G().mu);
    (void) kernelName(kernel, signature);
    ++G().occupancyQueries[kernel];
}

cudaError_t setLastError(cudaError_t e)
{
    if (e != cudaSuccess)
    {
        tlLastError = e;
    }
    return e;
}

cudaError_t occupancy(void const* kernel, int* numBlocks, int blockSize, std::size_t smem)
{
    if (numBlocks == nullptr || blockSize <= 0 || blockSize > 1024)
    {
        return setLastError(cudaErrorInvalidValue);
    }
    DeviceConfig cfg;
    int perKernel = -1;
    {
        std::lock_guard<std::mutex> lock(G().mu);
        cfg = configOf(G().current);
        if (!cfg.occupancy.empty())
        {
            auto const it = cfg.occupancy.find(kernelName(kernel, ""));
            perKernel = it != cfg.occupancy.end() ? it->second : -1;
        }
    }
    int const limit = perKernel >= 0 ? perKernel : cfg.blocksPerSm;
    int byThreads = cfg.maxThreadsPerSm / blockSize;
    int bySmem = smem > 0 ? static_cast<int>(static_cast<std::size_t>(cfg.sharedMemPerSm) / smem) : limit;
    *numBlocks = std::max(0, std::min({limit, byThreads, bySmem}));
    return cudaSuccess;
}

float rsqrtCorrectlyRounded(float x)
{
    if (x != x || x < 0.0F)
    {
        return floatOf(0x7FFFFFFFU);
    }
    if (x == 0.0F)
    {
        return std::copysign(std::numeric_limits<float>::infinity(), x);
    }
    if (std::isinf(x))
    {
        return 0.0F;
    }
    auto const xd = static_cast<double>(x);
    auto r = static_cast<float>(1.0 / std::sqrt(xd));
    // true value 1/sqrt(x) > m  <=>  m*m*x < 1; m has <= 25 significant bits, so m*m is exact and
    // p + e (fma) is m*m*x exactly; p alone decides unless it is exactly 1.
    auto above = [xd](double m) {
        double const m2 = m * m;
        double const prod = m2 * xd;
        double const err = std::fma(m2, xd, -prod);
        return prod != 1.0 ? prod < 1.0 : err < 0.0;
    };
    float const hi = std::nextafter(r, std::numeric_limits<float>::infinity());
    float const lo = std::nextafter(r, 0.0F);
    if (above((static_cast<double>(r) + hi) / 2.0))
    {
        r = hi;
    }
    else if (!above((static_cast<double>(lo) + r) / 2.0))
    {
        r = lo;
    }
    return r;
}

} // namespace detail
} // namespace simt

char const* cudaGetErrorName(cudaError_t e)
{
    switch (e)
    {
    case cudaSuccess: return "cudaSuccess";
    case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
    case cudaErrorInitializationError: return "cudaErrorInitializationError";
    case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidSymbol: return "cudaErrorInvalidSymbol";
    case cudaErrorInvalidDeviceFunction: return "cudaErrorInvalidDeviceFunction";
    case cudaErrorNoDevice: return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle: return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady: return "cudaErrorNotReady";
    case cudaErrorIllegalAddress: return "cudaErrorIllegalAddress";
    case cudaErrorLaunchOutOfResources: return "cudaErrorLaunchOutOfResources";
    case cudaErrorLaunchTimeout: return "cudaErrorLaunchTimeout";
    case cudaErrorAssert: return "cudaErrorAssert";
    case cudaErrorIllegalInstruction: return "cudaErrorIllegalInstruction";
    case cudaErrorMisalignedAddress: return "cudaErrorMisalignedAddress";
    case cudaErrorLaunchFailure: return "cudaErrorLaunchFailure";
    case cudaErrorNotSupported: return "cudaErrorNotSupported";
    case cudaErrorUnknown: return "cudaErrorUnknown";
    }
    return "cudaErrorUnknown";
}

char const* cudaGetErrorString(cudaError_t e)
{
    switch (e)
    {
    case cudaSuccess: return "no error";
    case cudaErrorInvalidValue: return "invalid argument";
    case cudaErrorMemoryAllocation: return "out of memory";
    case cudaErrorInvalidConfiguration: return "invalid configuration argument";
    case cudaErrorInvalidDeviceFunction: return "invalid device function";
    case cudaErrorInvalidDevice: return "invalid device ordinal";
    case cudaErrorMisalignedAddress: return "misaligned address";
    case cudaErrorLaunchFailure: return "unspecified launch failure";
    case cudaErrorNotSupported: return "operation not supported";
    default: return cudaGetErrorName(e);
    }
}

cudaError_t cudaGetLastError()
{
    cudaError_t const e = simt::internal::tlLastError;
    simt::internal::tlLastError = cudaSuccess;
    return e;
}

cudaError_t cudaPeekAtLastError()
{
    return simt::internal::tlLastError;
}

cudaError_t cudaGetDevice(int* device)
{
    if (device == nullptr)
    {
        return simt::detail::setLastError(cudaErrorInvalidValue);
    }
    std::lock_guard<std::mutex> lock(simt::internal::G().mu);
    *device = simt::internal::G().current;
    return cudaSuccess;
}

cudaError_t cudaSetDevice(int device)
{
    std::lock_guard<std::mutex> lock(simt::internal::G().mu);
    if (device < 0 || device >= static_cast<int>(simt::internal::G().devices.size()))
    {
        return simt::detail::setLastError(cudaErrorInvalidDevice);
    }
    simt::internal::G().current = device;
    return cudaSuccess;
}

cudaError_t cudaGetDeviceCount(int* count)
{
    if (count == nullptr)
    {
        return simt::detail::setLastError(cudaErrorInvalidValue);
    }
    std::lock_guard<std::mutex> lock(simt::internal::G().mu);
    *count = static_cast<int>(simt::internal::G().devices.size());
    return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device)
{
    if (value == nullptr)
    {
        return simt::detail::setLastError(cudaErrorInvalidValue);
    }
    simt::DeviceConfig cfg;
    {
        std::lock_guard<std::mutex> lock(simt::internal::G().mu);
        if (device < 0 || device >= static_cast<int>(simt::internal::G().devices.size()))
        {
            return simt::detail::setLastError(cudaErrorInvalidDevice);
        }
        cfg = simt::internal::G().devices[static_cast<std::size_t>(device)];
    }
    switch (attr)
    {
    case cudaDevAttrMaxThreadsPerBlock: *value = 1024; break;
    case cudaDevAttrMaxBlockDimX: *value = 1024; break;
    case cudaDevAttrMaxBlockDimY: *value = 1024; break;
    case cudaDevAttrMaxBlockDimZ: *value = 64; break;
    case cudaDevAttrMaxGridDimX: *value = 0x7FFFFFFF; break;
    case cudaDevAttrMaxGridDimY: *value = 65535; break;
    case cudaDevAttrMaxGridDimZ: *value = 65535; break;
    case cudaDevAttrMaxSharedMemoryPerBlock: *value = 48 * 1024; break;
    case cudaDevAttrTotalConstantMemory: *value = 64 * 1024; break;
    case cudaDevAttrWarpSize: *value = 32; break;
    case cudaDevAttrMaxRegistersPerBlock: *value = 65536; break;
    case cudaDevAttrClockRate: *value = cfg.clockKHz; break;
    case cudaDevAttrMultiProcessorCount: *value = cfg.numSms; break;
    case cudaDevAttrConcurrentKernels: *value = 1; break;
    case cudaDevAttrMemoryClockRate: *value = cfg.memClockKHz; break;
    case cudaDevAttrGlobalMemoryBusWidth: *value = cfg.busWidthBits; break;
    case cudaDevAttrL2CacheSize: *value = cfg.l2CacheBytes; break;
    case cudaDevAttrMaxThreadsPerMultiProcessor: *value = cfg.maxThreadsPerSm; break;
    case cudaDevAttrComputeCapabilityMajor: *value = cfg.ccMajor; break;
    case cudaDevAttrComputeCapabilityMinor: *value = cfg.ccMinor; break;
    case cudaDevAttrMaxSharedMemoryPerMultiprocessor: *value = cfg.sharedMemPerSm; break;
    case cudaDevAttrMaxRegistersPerMultiprocessor: *value = 65536; break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = 227 * 1024; break;
    case cudaDevAttrMaxBlocksPerMultiprocessor: *value = 32; break;
    default: return simt::detail::setLastError(cudaErrorInvalidValue);
    }
    return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device)
{
    if (prop == nullptr)
    {
        return simt::detail::setLastError(cudaErrorInvalidValue);
    }
    int sms = 0;
    cudaError_t const e = cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
    if (e != cudaSuccess)
    {
        return e;
    }
    simt::DeviceConfig cfg;
    {
        std::lock_guard<std::mutex> lock(simt::internal::G().mu);
        cfg = simt::internal::G().devices[static_cast<std::size_t>(device)];
    }
    *prop = cudaDeviceProp{};
    std::snprintf(prop->name, sizeof(prop->name), "qkrope SIMT emulator (%d SMs x %d blocks)", cfg.numSms, cfg.blocksPerSm);
    prop->totalGlobalMem = std::size_t{1} << 34;
    prop->sharedMemPerBlock = 48 * 1024;
    prop->regsPerBlock = 65536;
    prop->warpSize = 32;
    prop->maxThreadsPerBlock = 1024;
    prop->maxThreadsDim[0] = 1024;
    prop->maxThreadsDim[1] = 1024;
    prop->maxThreadsDim[2] = 64;
    prop->maxGridSize[0] = 0x7FFFFFFF;
    prop->maxGridSize[1] = 65535;
    prop->maxGridSize[2] = 65535;
    prop->major = 9;
    prop->minor = 0;
    prop->multiProcessorCount = cfg.numSms;
    prop->l2CacheSize = cfg.l2CacheBytes;
    prop->maxThreadsPerMultiProcessor = cfg.maxThreadsPerSm;
    prop->sharedMemPerMultiprocessor = static_cast<std::size_t>(cfg.sharedMemPerSm);
    prop->maxBlocksPerMultiProcessor = 32;
    return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize()
{
    return cudaSuccess;
}

cudaError_t cudaStreamSynchronize(cudaStream_t)
{
    return cudaSuccess;
}

cudaError_t cudaMalloc(void** ptr, std::size_t bytes)
{
    if (ptr == nullptr)
    {
        return simt::detail::setLastError(cudaErrorInvalidValue);
    }
    *ptr = std::aligned_alloc(256, (bytes + 255) / 256 * 256 + 256);
    return *ptr != nullptr ? cudaSuccess : simt::detail::setLastError(cudaErrorMemoryAllocation);
}

cudaError_t cudaFree(void* ptr)
{
    std::free(ptr);
    return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, void const* src, std::size_t bytes, cudaMemcpyKind)
{
    if (bytes != 0)
    {
        std::memmove(dst, src, bytes);
    }
    return cudaSuccess;
}

cudaError_t cudaMemcpyAsync(void* dst, void const* src, std::size_t bytes, cudaMemcpyKind kind, cudaStream_t)
{
    return cudaMemcpy(dst, src, bytes, kind);
}

cudaError_t cudaMemset(void* dst, int value, std::size_t bytes)
{
    if (bytes != 0)
    {
        std::memset(dst, value, bytes);
    }
    return cudaSuccess;
}

cudaError_t cudaMemsetAsync(void* dst, int value, std::size_t bytes, cudaStream_t)
{
    return cudaMemset(dst, value, bytes);
}
