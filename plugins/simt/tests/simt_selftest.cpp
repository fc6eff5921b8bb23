// qkrope SIMT emulation: self-test kernels of the emulator (libsimt_selftest.so), driven from
// tests/test_kernel_simt_emulator.py through ctypes. Each simt_selftest_* function launches one
// small kernel through cudaLaunchKernel, as the real launcher does, and returns the cudaError_t; the
// emulator's message is then read with simt_last_error (exported here as well).
//
// What they prove: shuffle results (idx/up/down/xor, every width, arbitrary per-lane arguments)
// against an independent Python model of the CUDA semantics; that a lane skipping a collective,
// mismatched masks / widths / intrinsics and a caller outside its mask are reported, not hung on;
// __syncthreads is a real block barrier; __shared__ is shared within a block and distinct between
// launches running concurrently on two OS threads; the vote / match / reduce intrinsics; the
// alignment check of the vector load intrinsics; the bf16/fp16 conversions and __frsqrt_rn.
#include <cuda_pipeline_primitives.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <chrono>
#include <cstdint>
#include <thread>

#define SELFTEST_EXPORT extern "C" __attribute__((visibility("default")))

namespace
{

constexpr unsigned kFull = 0xFFFFFFFFU;

template <typename... Params, typename... Args>
cudaError_t launch(void (*kernel)(Params...), dim3 grid, dim3 block, Args... args)
{
    return SIMT_LAUNCH(kernel, grid, block, 0, nullptr, args...);
}

// op: 0 idx, 1 up, 2 down, 3 xor. Lane value 1000 * warp + lane (int) and the same + 0.5 (float).
__global__ void shflKernel(int op, int width, int const* args, int* out, float* fout)
{
    int const tid = static_cast<int>(threadIdx.x);
    int const lane = tid % 32;
    int const warp = tid / 32;
    int const v = 1000 * warp + lane;
    float const fv = static_cast<float>(v) + 0.5F;
    int const a = args[tid];
    int r = 0;
    float fr = 0.0F;
    switch (op)
    {
    case 0:
        r = __shfl_sync(kFull, v, a, width);
        fr = __shfl_sync(kFull, fv, a, width);
        break;
    case 1:
        r = __shfl_up_sync(kFull, v, static_cast<unsigned>(a), width);
        fr = __shfl_up_sync(kFull, fv, static_cast<unsigned>(a), width);
        break;
    case 2:
        r = __shfl_down_sync(kFull, v, static_cast<unsigned>(a), width);
        fr = __shfl_down_sync(kFull, fv, static_cast<unsigned>(a), width);
        break;
    default:
        r = __shfl_xor_sync(kFull, v, a, width);
        fr = __shfl_xor_sync(kFull, fv, a, width);
        break;
    }
    out[tid] = r;
    fout[tid] = fr;
}

__global__ void skipKernel(int skipLane, int* out)
{
    int const lane = static_cast<int>(threadIdx.x) % 32;
    if (lane == skipLane)
    {
        return; // skips the shuffle every other lane waits in
    }
    out[threadIdx.x] = __shfl_xor_sync(kFull, lane, 1);
}

// mode 0: lane 0 uses the full mask, the others exclude lane 0
// mode 1: lane 3 calls with a mask that does not contain itself
// mode 2: lanes < 16 width 16, others width 32
// mode 3: even lanes __shfl_xor_sync, odd lanes __shfl_down_sync
// mode 4: lanes < 16 __syncwarp, the others a shuffle
// mode 5: threads >= 32 exit, the others __syncthreads
// mode 6: lane 0 waits at __syncthreads while the warp shuffles
// mode 7: a non-power-of-two width (the `arg`)
// mode 8: a shuffle reading a lane outside the mask
// mode 9: misaligned 128-bit load through __ldcs
__global__ void misuseKernel(int mode, int arg, int* out)
{
    int const tid = static_cast<int>(threadIdx.x);
    int const lane = tid % 32;
    int r = 0;
    switch (mode)
    {
    case 0: r = __shfl_sync(lane == 0 ? kFull : 0xFFFFFFFEU, lane, 1); break;
    case 1: r = __shfl_sync(lane == 3 ? 0x1U : kFull, lane, 0); break;
    case 2: r = __shfl_xor_sync(kFull, lane, 1, lane < 16 ? 16 : 32); break;
    case 3: r = (lane % 2 == 0) ? __shfl_xor_sync(kFull, lane, 1) : __shfl_down_sync(kFull, lane, 1); break;
    case 4:
        if (lane < 16)
        {
            __syncwarp();
        }
        else
        {
            r = __shfl_sync(kFull, lane, 0);
        }
        break;
    case 5:
        if (tid >= 32)
        {
            return;
        }
        __syncthreads();
        break;
    case 6:
        if (lane == 0)
        {
            __syncthreads();
        }
        r = __shfl_sync(kFull, lane, 0);
        break;
    case 7: r = __shfl_xor_sync(kFull, lane, 1, arg); break;
    case 8: r = __shfl_sync(0x0000FFFFU << (lane < 16 ? 0 : 16), lane, 20); break;
    case 9:
    {
        uint4 const v = __ldcs(reinterpret_cast<uint4 const*>(reinterpret_cast<char const*>(out) + 4));
        r = static_cast<int>(v.x);
        break;
    }
    default: break;
    }
    out[tid] = r;
}

// Lanes >= 16 exit; the others shuffle within their half (CUDA: only non-exited lanes of the
// mask take part) -- legal, and nobody reads an exited lane.
__global__ void exitEarlyKernel(int* out)
{
    int const lane = static_cast<int>(threadIdx.x) % 32;
    if (lane >= 16)
    {
        return;
    }
    int const r = __shfl_xor_sync(kFull, lane, 1, 16);
    out[threadIdx.x] = r + (__ballot_sync(kFull, 1) == 0xFFFFU ? 100 : 0); // the participants' ballot
}

__global__ void syncthreadsKernel(int* out)
{
    __shared__ int s[1024];
    int const tid = static_cast<int>(threadIdx.x);
    int const n = static_cast<int>(blockDim.x);
    s[tid] = 7 * tid + 1000 * static_cast<int>(blockIdx.x);
    __syncthreads();
    int const v = s[(tid + 1) % n];
    __syncthreads(); // the next block (or a later write) must not overwrite before everyone read
    out[blockIdx.x * blockDim.x + threadIdx.x] = v;
}

__global__ void sharedIsolationKernel(int value, int sleepMs, int* out)
{
    __shared__ int s[256];
    int const tid = static_cast<int>(threadIdx.x);
    int const n = static_cast<int>(blockDim.x);
    s[tid] = value + tid;
    __syncthreads();
    if (tid == 0)
    {
        std::this_thread::sleep_for(std::chrono::milliseconds(sleepMs)); // the other launch writes meanwhile
    }
    __syncthreads();
    out[tid] = s[(tid + 1) % n] - value;
}

// cp.async: three groups of one 16-byte copy each into a thread's slots that hold -1. out per
// thread (6 ints): slot 0 read before any wait (stale: -1), slot 0 after wait_prior(2) (landed),
// slot 1 after wait_prior(2) (its group still pending: -1), slot 1 after wait_prior(1), slot 2
// after wait_prior(0), and the neighbour's slot 2 after __syncthreads (the copies of every
// thread landed before the barrier).
__global__ void asyncCopyKernel(int4 const* src, int* out)
{
    __shared__ __align__(16) int4 slots[3][64];
    int const tid = static_cast<int>(threadIdx.x);
    int const n = static_cast<int>(blockDim.x);
    for (int g = 0; g < 3; ++g)
    {
        slots[g][tid] = make_int4(-1, -1, -1, -1);
    }
    for (int g = 0; g < 3; ++g)
    {
        __pipeline_memcpy_async(&slots[g][tid], src + g * n + tid, sizeof(int4));
        __pipeline_commit();
    }
    int* o = out + 6 * tid;
    o[0] = slots[0][tid].x;
    __pipeline_wait_prior(2);
    o[1] = slots[0][tid].x;
    o[2] = slots[1][tid].x;
    __pipeline_wait_prior(1);
    o[3] = slots[1][tid].x;
    __pipeline_wait_prior(0);
    o[4] = slots[2][tid].x;
    __syncthreads();
    o[5] = slots[2][(tid + 1) % n].x;
}

// out per thread (8 ints): ballot, any, all, match_any, match_all (+pred), reduce_add, reduce_max
__global__ void voteKernel(int* out)
{
    int const tid = static_cast<int>(threadIdx.x);
    int const lane = tid % 32;
    int* o = out + 8 * tid;
    o[0] = static_cast<int>(__ballot_sync(kFull, lane % 3 == 0));
    o[1] = __any_sync(kFull, lane == 31);
    o[2] = __all_sync(kFull, lane < 31);
    o[3] = static_cast<int>(__match_any_sync(kFull, lane % 4));
    int pred = -1;
    o[4] = static_cast<int>(__match_all_sync(kFull, 5, &pred));
    o[5] = pred;
    o[6] = static_cast<int>(__reduce_add_sync(kFull, static_cast<unsigned>(lane)));
    o[7] = __reduce_max_sync(kFull, lane % 7 - 3);
}

} // namespace

SELFTEST_EXPORT int32_t simt_selftest_shfl(int32_t op, int32_t width, int32_t const* args, int32_t nthreads,
    int32_t* out, float* fout)
{
    return launch(shflKernel, dim3(1), dim3(static_cast<unsigned>(nthreads)), static_cast<int>(op),
        static_cast<int>(width), args, out, fout);
}

SELFTEST_EXPORT int32_t simt_selftest_skip(int32_t skipLane, int32_t* out)
{
    return launch(skipKernel, dim3(1), dim3(32), static_cast<int>(skipLane), out);
}

SELFTEST_EXPORT int32_t simt_selftest_misuse(int32_t mode, int32_t arg, int32_t nthreads, int32_t* out)
{
    return launch(misuseKernel, dim3(1), dim3(static_cast<unsigned>(nthreads)), static_cast<int>(mode),
        static_cast<int>(arg), out);
}

SELFTEST_EXPORT int32_t simt_selftest_exit_early(int32_t* out)
{
    return launch(exitEarlyKernel, dim3(1), dim3(32), out);
}

SELFTEST_EXPORT int32_t simt_selftest_syncthreads(int32_t blocks, int32_t nthreads, int32_t* out)
{
    return launch(syncthreadsKernel, dim3(static_cast<unsigned>(blocks)), dim3(static_cast<unsigned>(nthreads)), out);
}

SELFTEST_EXPORT int32_t simt_selftest_shared_isolation(int32_t value, int32_t sleepMs, int32_t* out)
{
    return launch(sharedIsolationKernel, dim3(1), dim3(256), static_cast<int>(value), static_cast<int>(sleepMs), out);
}

SELFTEST_EXPORT int32_t simt_selftest_async_copy(int32_t nthreads, int32_t const* src, int32_t* out)
{
    return launch(asyncCopyKernel, dim3(1), dim3(static_cast<unsigned>(nthreads)),
        reinterpret_cast<int4 const*>(src), out);
}

SELFTEST_EXPORT int32_t simt_selftest_vote(int32_t* out)
{
    return launch(voteKernel, dim3(1), dim3(64), out);
}

// Conversions with the device's rules (host-callable functions of the stand-in headers).
SELFTEST_EXPORT void simt_selftest_convert(float const* in, uint16_t* bf16, uint16_t* fp16, float* fp16Back,
    float* bf16Back, int32_t n)
{
    for (int32_t i = 0; i < n; ++i)
    {
        bf16[i] = __bfloat16_as_ushort(__float2bfloat16_rn(in[i]));
        fp16[i] = __half_as_ushort(__float2half_rn(in[i]));
        fp16Back[i] = __half2float(__ushort_as_half(fp16[i]));
        bf16Back[i] = __bfloat162float(__ushort_as_bfloat16(bf16[i]));
    }
}

SELFTEST_EXPORT void simt_selftest_frsqrt(float const* in, float* out, int32_t n)
{
    for (int32_t i = 0; i < n; ++i)
    {
        out[i] = __frsqrt_rn(in[i]);
    }
}
