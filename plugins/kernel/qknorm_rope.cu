// qkrope: the fused QK-RMSNorm + RoPE CUDA kernel (spec section 3) and its launcher.
//
// Fast path (head_dim 64/128/256, 16-byte aligned tensors): one block of 256 threads works on
// one token at a time (grid-stride over tokens). Within the block, a "row group" of L threads
// (L = head_dim / elements-per-128-bit-vector, at most 32) owns one (token, head) row of q or k;
// the block's 256 / L row groups walk the token's 2*H rows (q heads, then k heads). Every
// thread always owns the same element positions of a row, so
//   - its q and k weights are loaded once for the whole kernel (registers),
//   - its cos/sin values are loaded once per token (registers) and reused for every head of q
//     and k it processes: the cache row is read from memory once per token per block,
//   - UNROLL rows (1..4, a template parameter) are loaded (128-bit, streaming) before any is
//     computed, to keep enough bytes in flight per SM. The launcher picks UNROLL from the row-group
//     passes a block makes over its rows: as many rows as possible in the fewest rounds, spread
//     evenly (unrollFor), so no empty slot is carried through registers, math and shuffles.
//     Qwen-Image bf16/fp16, head_dim 128: 48 rows per token, 16 per pass -> UNROLL 3 in one round
//     (before: a fixed 4 with the 4th slot always empty, 80 registers on sm_90 -> now 75).
// The sum of squares is reduced with xor shuffles inside the row group; NeoX pairs that live in
// another thread are exchanged with a shuffle whose lane index is relative to the row group (so
// partial rotary with several rows per warp is correct). When there are few tokens the 2*H rows
// of a token are split over blockIdx.y so that small problems still fill the GPU.
//
// General path (any even head_dim <= 512, any alignment, NeoX layouts the fast path does not
// cover): one warp per row, the normalised row staged in shared memory for the pair exchange.
//
// All index arithmetic that can exceed 2^31 is int64.
#include "qknorm_rope.h"
#include "qknorm_rope_math.h"

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <tuple>
#include <type_traits>
#include <utility>

namespace qkrope
{
namespace
{

using math::Bf16;
using math::Fp16;
using math::Fp32;

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / 32;
constexpr int kMaxUnroll = 4;     // at most this many rows per thread loaded before any is computed
constexpr int kFastMinBlocks = 3; // >= 768 resident threads per SM (<= 85 registers)
constexpr int kMaxDevices = 64;
constexpr unsigned kFullMask = 0xFFFFFFFFU;

struct KernelArgs
{
    void const* q;
    void const* k;
    void const* qWeight;
    void const* kWeight;
    float const* cache;
    void* qOut;
    void* kOut;
    int64_t numTokens; // batch * seqLen
    int64_t seqLen;
    int32_t numHeads;
    int32_t headDim;
    int32_t rotaryDim;
    int32_t rowsPerSplit; // fast path: rows of a token handled per blockIdx.y
    float eps;
    int32_t rounding;
};

template <typename T, int HEAD_DIM>
struct FastConfig
{
    using Storage = typename T::Storage;
    static constexpr int kVec = 16 / static_cast<int>(sizeof(Storage)); // elements per 128 bits
    static constexpr int kChunks = HEAD_DIM / kVec;                      // 128-bit chunks per row
    static constexpr int kLanes = kChunks < 32 ? kChunks : 32;          // threads per row
    static constexpr int kNV = kChunks / kLanes;                         // chunks per thread
    static constexpr int kElems = kNV * kVec;                            // elements per thread
    static constexpr int kRowsPerPass = kThreads / kLanes;
    static_assert(HEAD_DIM % kVec == 0 && kChunks % kLanes == 0, "bad head_dim");
    static_assert((kLanes & (kLanes - 1)) == 0 && 32 % kLanes == 0, "row group must divide a warp");
};

template <typename Storage, int N>
struct alignas(16) Vec
{
    Storage v[N];
};

template <typename T, int N>
__device__ __forceinline__ void loadStreaming(typename T::Storage const* p, float (&out)[N])
{
    using V = Vec<typename T::Storage, N>;
    static_assert(sizeof(V) == 16, "one 128-bit access");
    uint4 const raw = __ldcs(reinterpret_cast<uint4 const*>(p));
    V const vec = *reinterpret_cast<V const*>(&raw);
#pragma unroll
    for (int i = 0; i < N; ++i)
    {
        out[i] = T::toFloat(vec.v[i]);
    }
}

template <typename T, int N>
__device__ __forceinline__ void loadCached(typename T::Storage const* p, float* out)
{
    using V = Vec<typename T::Storage, N>;
    uint4 const raw = __ldg(reinterpret_cast<uint4 const*>(p));
    V const vec = *reinterpret_cast<V const*>(&raw);
#pragma unroll
    for (int i = 0; i < N; ++i)
    {
        out[i] = T::toFloat(vec.v[i]);
    }
}

template <typename T, int N>
__device__ __forceinline__ void storeStreaming(typename T::Storage* p, float const* in)
{
    using V = Vec<typename T::Storage, N>;
    V vec;
#pragma unroll
    for (int i = 0; i < N; ++i)
    {
        vec.v[i] = T::fromFloat(in[i]);
    }
    __stcs(reinterpret_cast<uint4*>(p), *reinterpret_cast<uint4 const*>(&vec));
}

// ---------------------------------------------------------------------------------------------
// Fast path.
template <typename T, int HEAD_DIM, bool INTERLEAVED, int UNROLL>
__global__ void __launch_bounds__(kThreads, kFastMinBlocks) qkNormRopeFastKernel(KernelArgs const a)
{
    static_assert(UNROLL >= 1 && UNROLL <= kMaxUnroll, "bad unroll");
    using C = FastConfig<T, HEAD_DIM>;
    using Storage = typename T::Storage;
    constexpr int kVec = C::kVec;
    constexpr int kLanes = C::kLanes;
    constexpr int kNV = C::kNV;
    constexpr int kElems = C::kElems;
    constexpr int kRowsPerPass = C::kRowsPerPass;
    // cos/sin values a thread needs: one per pair it owns (interleaved) or one per element (NeoX)
    constexpr int kTrig = INTERLEAVED ? kElems / 2 : kElems;

    int const lane = static_cast<int>(threadIdx.x) % kLanes; // position inside the row group
    int const group = static_cast<int>(threadIdx.x) / kLanes;
    int const numHeads = a.numHeads;
    int const rowBegin = static_cast<int>(blockIdx.y) * a.rowsPerSplit;
    int const rowEnd = min(rowBegin + a.rowsPerSplit, 2 * numHeads);
    int const rot = a.rotaryDim;
    int const half = rot / 2;

    // Element index of element i of this thread's chunk v.
    auto elem = [lane](int v, int i) { return (v * kLanes + lane) * kVec + i; };

    // NeoX exchange partner (kNV == 1): the lane holding element e +/- half, relative to the group.
    int const halfChunks = half / kVec;
    int const rotChunks = rot / kVec;
    int const partner = lane < halfChunks ? lane + halfChunks : (lane < rotChunks ? lane - halfChunks : lane);

    // Weights: loaded once per thread for the whole kernel.
    float qw[kElems];
    float kw[kElems];
#pragma unroll
    for (int v = 0; v < kNV; ++v)
    {
        loadCached<T, kVec>(static_cast<Storage const*>(a.qWeight) + elem(v, 0), qw + v * kVec);
        loadCached<T, kVec>(static_cast<Storage const*>(a.kWeight) + elem(v, 0), kw + v * kVec);
    }

    for (int64_t t = blockIdx.x; t < a.numTokens; t += gridDim.x)
    {
        // This token's cos/sin, once, reused for all its q and k heads.
        float const* cacheRow = a.cache + (t % a.seqLen) * static_cast<int64_t>(rot);
        float cosv[kTrig];
        float sinv[kTrig];
#pragma unroll
        for (int p = 0; p < kTrig; ++p)
        {
            int const e = INTERLEAVED ? elem(p / (kVec / 2), 2 * (p % (kVec / 2))) : elem(p / kVec, p % kVec);
            int const j = INTERLEAVED ? e / 2 : (e < half ? e : e - half);
            bool const rotated = e < rot;
            cosv[p] = rotated ? __ldg(cacheRow + j) : 1.0F;
            sinv[p] = rotated ? __ldg(cacheRow + half + j) : 0.0F;
        }

        int64_t const tokenRow = t * numHeads; // row index of (t, head 0)
        for (int rBase = rowBegin; rBase < rowEnd; rBase += kRowsPerPass * UNROLL)
        {
            float x[UNROLL][kElems];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u)
            {
                int const r = rBase + u * kRowsPerPass + group;
                if (r < rowEnd)
                {
                    bool const isQ = r < numHeads;
                    int64_t const offset = (tokenRow + (isQ ? r : r - numHeads)) * HEAD_DIM;
                    Storage const* src = static_cast<Storage const*>(isQ ? a.q : a.k) + offset;
#pragma unroll
                    for (int v = 0; v < kNV; ++v)
                    {
                        float tmp[kVec];
                        loadStreaming<T, kVec>(src + elem(v, 0), tmp);
#pragma unroll
                        for (int i = 0; i < kVec; ++i)
                        {
                            x[u][v * kVec + i] = tmp[i];
                        }
                    }
                }
                else
                {
#pragma unroll
                    for (int i = 0; i < kElems; ++i)
                    {
                        x[u][i] = 0.0F;
                    }
                }
            }

#pragma unroll
            for (int u = 0; u < UNROLL; ++u)
            {
                int const r = rBase + u * kRowsPerPass + group;
                bool const isQ = r < numHeads;

                float sumSq = 0.0F;
#pragma unroll
                for (int i = 0; i < kElems; ++i)
                {
                    sumSq = math::add(sumSq, math::mul(x[u][i], x[u][i]));
                }
#pragma unroll
                for (int offset = kLanes / 2; offset > 0; offset /= 2)
                {
                    sumSq = math::add(sumSq, __shfl_xor_sync(kFullMask, sumSq, offset));
                }
                float const inv = math::rmsInv(sumSq, HEAD_DIM, a.eps);

                float y[kElems];
#pragma unroll
                for (int i = 0; i < kElems; ++i)
                {
                    y[i] = math::normalize<T>(x[u][i], inv, isQ ? qw[i] : kw[i], a.rounding);
                }

                float out[kElems];
                if constexpr (INTERLEAVED)
                {
#pragma unroll
                    for (int p = 0; p < kElems / 2; ++p)
                    {
                        float const ya = y[2 * p];
                        float const yb = y[2 * p + 1];
                        out[2 * p] = math::rotateFirst(ya, yb, cosv[p], sinv[p]);
                        out[2 * p + 1] = math::rotateSecond(ya, yb, cosv[p], sinv[p]);
                        // elements >= rotary_dim: cos = 1, sin = 0 would be exact too, but keep
                        // them untouched explicitly (no -0.0 / NaN surprises).
                        if (elem((2 * p) / kVec, (2 * p) % kVec) >= rot)
                        {
                            out[2 * p] = ya;
                            out[2 * p + 1] = yb;
                        }
                    }
                }
                else if constexpr (kNV == 1)
                {
#pragma unroll
                    for (int i = 0; i < kElems; ++i)
                    {
                        // every lane of the warp takes part in the shuffle
                        float const other = __shfl_sync(kFullMask, y[i], partner, kLanes);
                        int const e = elem(0, i);
                        if (e < half)
                        {
                            out[i] = math::rotateFirst(y[i], other, cosv[i], sinv[i]);
                        }
                        else if (e < rot)
                        {
                            out[i] = math::rotateSecond(other, y[i], cosv[i], sinv[i]);
                        }
                        else
                        {
                            out[i] = y[i];
                        }
                    }
                }
                else
                {
                    // kNV == 2 with rotary_dim == head_dim: chunk v = 0 holds the first halves,
                    // chunk v = 1 the partners, in the same thread.
                    static_assert(kNV == 2, "NeoX in-thread pairing expects two chunks per thread");
#pragma unroll
                    for (int i = 0; i < kVec; ++i)
                    {
                        float const ya = y[i];
                        float const yb = y[kVec + i];
                        out[i] = math::rotateFirst(ya, yb, cosv[i], sinv[i]);
                        out[kVec + i] = math::rotateSecond(ya, yb, cosv[kVec + i], sinv[kVec + i]);
                    }
                }

                if (r < rowEnd)
                {
                    int64_t const offset = (tokenRow + (isQ ? r : r - numHeads)) * HEAD_DIM;
                    Storage* dst = static_cast<Storage*>(isQ ? a.qOut : a.kOut) + offset;
#pragma unroll
                    for (int v = 0; v < kNV; ++v)
                    {
                        storeStreaming<T, kVec>(dst + elem(v, 0), out + v * kVec);
                    }
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// General path: one warp per (token, q/k, head) row, any even head_dim <= 512.
constexpr int kGeneralPerLane = static_cast<int>(kMAX_HEAD_DIM) / 32;

template <typename T>
__global__ void __launch_bounds__(kThreads) qkNormRopeGeneralKernel(KernelArgs const a, bool const interleaved)
{
    using Storage = typename T::Storage;
    __shared__ float staged[kWarpsPerBlock][kMAX_HEAD_DIM];

    int const warp = static_cast<int>(threadIdx.x) / 32;
    int const lane = static_cast<int>(threadIdx.x) % 32;
    int const numHeads = a.numHeads;
    int const headDim = a.headDim;
    int const rot = a.rotaryDim;
    int const half = rot / 2;
    int64_t const rowsPerToken = 2 * static_cast<int64_t>(numHeads);
    int64_t const totalRows = a.numTokens * rowsPerToken;
    float* ys = staged[warp];

    for (int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp; row < totalRows;
         row += static_cast<int64_t>(gridDim.x) * kWarpsPerBlock)
    {
        int64_t const t = row / rowsPerToken;
        int const r = static_cast<int>(row - t * rowsPerToken);
        bool const isQ = r < numHeads;
        int64_t const offset = (t * numHeads + (isQ ? r : r - numHeads)) * static_cast<int64_t>(headDim);
        Storage const* src = static_cast<Storage const*>(isQ ? a.q : a.k) + offset;
        Storage const* w = static_cast<Storage const*>(isQ ? a.qWeight : a.kWeight);
        float const* cacheRow = a.cache + (t % a.seqLen) * static_cast<int64_t>(rot);

        float x[kGeneralPerLane];
        float sumSq = 0.0F;
#pragma unroll
        for (int i = 0; i < kGeneralPerLane; ++i)
        {
            int const e = lane + 32 * i;
            x[i] = e < headDim ? T::toFloat(src[e]) : 0.0F;
            sumSq = math::add(sumSq, math::mul(x[i], x[i]));
        }
#pragma unroll
        for (int o = 16; o > 0; o /= 2)
        {
            sumSq = math::add(sumSq, __shfl_xor_sync(kFullMask, sumSq, o));
        }
        float const inv = math::rmsInv(sumSq, headDim, a.eps);
#pragma unroll
        for (int i = 0; i < kGeneralPerLane; ++i)
        {
            int const e = lane + 32 * i;
            if (e < headDim)
            {
                ys[e] = math::normalize<T>(x[i], inv, T::toFloat(w[e]), a.rounding);
            }
        }
        __syncwarp();

        Storage* dst = static_cast<Storage*>(isQ ? a.qOut : a.kOut) + offset;
#pragma unroll
        for (int i = 0; i < kGeneralPerLane; ++i)
        {
            int const e = lane + 32 * i;
            if (e < headDim)
            {
                float result = ys[e];
                if (e < rot)
                {
                    int const j = interleaved ? e / 2 : (e < half ? e : e - half);
                    bool const first = interleaved ? (e % 2 == 0) : (e < half);
                    int const ia = interleaved ? 2 * j : j;
                    int const ib = interleaved ? 2 * j + 1 : j + half;
                    float const c = __ldg(cacheRow + j);
                    float const n = __ldg(cacheRow + half + j);
                    result = first ? math::rotateFirst(ys[ia], ys[ib], c, n) : math::rotateSecond(ys[ia], ys[ib], c, n);
                }
                dst[e] = T::fromFloat(result);
            }
        }
        __syncwarp(); // ys is rewritten by the next row
    }
}

// ---------------------------------------------------------------------------------------------
// Launch helpers.
int smCount(int device)
{
    static std::atomic<int> cached[kMaxDevices];
    if (device >= 0 && device < kMaxDevices)
    {
        int const c = cached[device].load(std::memory_order_relaxed);
        if (c > 0)
        {
            return c;
        }
    }
    int count = 0;
    if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || count <= 0)
    {
        // A failed query must not leave its error behind: the launch below would then report
        // kCUDA_ERROR although it succeeded (cudaGetLastError returns the last error of the thread).
        (void) cudaGetLastError();
        count = 1;
    }
    if (device >= 0 && device < kMaxDevices)
    {
        cached[device].store(count, std::memory_order_relaxed);
    }
    return count;
}

template <typename Kernel>
int blocksPerSm(Kernel kernel, int device, std::atomic<int>* cache)
{
    if (device >= 0 && device < kMaxDevices)
    {
        int const c = cache[device].load(std::memory_order_relaxed);
        if (c > 0)
        {
            return c;
        }
    }
    int blocks = 0;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, kThreads, 0) != cudaSuccess || blocks <= 0)
    {
        (void) cudaGetLastError(); // see smCount
        blocks = 1;
    }
    if (device >= 0 && device < kMaxDevices)
    {
        cache[device].store(blocks, std::memory_order_relaxed);
    }
    return blocks;
}

// The one place kernels are launched. cudaLaunchKernel returns the status of this launch itself,
// so an error left behind by earlier work on the thread is never reported as this launch's
// failure (cudaGetLastError after <<<>>> would). Each argument is converted to the kernel's
// parameter type first, so the runtime reads exactly the objects it expects. The SIMT emulation
// (plugins/simt) provides the same cudaLaunchKernel, which is how the unchanged source runs there.
template <typename... Params, typename... Args>
cudaError_t launchKernel(void (*kernel)(Params...), dim3 const grid, dim3 const block, cudaStream_t stream,
    Args&&... args)
{
    static_assert(sizeof...(Params) == sizeof...(Args), "one argument per kernel parameter");
    std::tuple<std::decay_t<Params>...> values(std::forward<Args>(args)...);
    return std::apply(
        [&](auto&... v) {
            void* argv[] = {static_cast<void*>(&v)...};
            return cudaLaunchKernel(kernel, grid, block, argv, 0, stream);
        },
        values);
}

int64_t ceilDiv(int64_t a, int64_t b)
{
    return (a + b - 1) / b;
}

template <typename T, int HEAD_DIM, bool INTERLEAVED, int UNROLL>
cudaError_t launchFastUnrolled(KernelArgs const& a, dim3 const grid, cudaStream_t stream)
{
    return launchKernel(qkNormRopeFastKernel<T, HEAD_DIM, INTERLEAVED, UNROLL>, grid, dim3(kThreads), stream, a);
}

// Rows per thread loaded before any is computed, for `passes` row-group passes per block: as many
// as possible (<= kMaxUnroll) in the fewest rounds, spread evenly, so no slot is carried through
// the registers and the shuffles empty (Qwen-Image bf16/fp16 head_dim 128: 48 rows of a token,
// 16 per pass -> 3 passes -> UNROLL 3, one round; fp32: 6 passes -> 2 rounds of 3).
int64_t unrollFor(int64_t passes)
{
    int64_t const rounds = ceilDiv(passes, kMaxUnroll);
    return ceilDiv(passes, rounds);
}

template <typename T, int HEAD_DIM, bool INTERLEAVED>
cudaError_t launchFast(KernelArgs a, int device, cudaStream_t stream)
{
    using C = FastConfig<T, HEAD_DIM>;
    // The grid is sized with the occupancy of the most register-hungry instance (UNROLL 4), so the
    // split decision does not depend on the unroll it then selects.
    static std::atomic<int> occupancy[kMaxDevices];
    int64_t const target = static_cast<int64_t>(blocksPerSm(qkNormRopeFastKernel<T, HEAD_DIM, INTERLEAVED, kMaxUnroll>,
                               device, occupancy))
        * smCount(device);

    int64_t const rowsPerToken = 2 * static_cast<int64_t>(a.numHeads);
    int64_t const passes = ceilDiv(rowsPerToken, C::kRowsPerPass);
    int64_t splits = 1;
    if (a.numTokens < target)
    {
        splits = ceilDiv(target, a.numTokens);
        splits = splits < passes ? splits : passes;
    }
    int64_t const passesPerSplit = ceilDiv(passes, splits);
    int64_t const rowsPerSplit = passesPerSplit * C::kRowsPerPass;
    splits = ceilDiv(rowsPerToken, rowsPerSplit);
    a.rowsPerSplit = static_cast<int32_t>(rowsPerSplit);

    int64_t gridX = a.numTokens;
    int64_t const maxGridX = target * 16; // beyond that, blocks loop over tokens
    gridX = gridX < maxGridX ? gridX : maxGridX;
    dim3 const grid(static_cast<unsigned>(gridX), static_cast<unsigned>(splits), 1);
    switch (unrollFor(passesPerSplit))
    {
    case 1: return launchFastUnrolled<T, HEAD_DIM, INTERLEAVED, 1>(a, grid, stream);
    case 2: return launchFastUnrolled<T, HEAD_DIM, INTERLEAVED, 2>(a, grid, stream);
    case 3: return launchFastUnrolled<T, HEAD_DIM, INTERLEAVED, 3>(a, grid, stream);
    default: return launchFastUnrolled<T, HEAD_DIM, INTERLEAVED, 4>(a, grid, stream);
    }
}

template <typename T>
cudaError_t launchGeneral(KernelArgs const& a, bool interleaved, int device, cudaStream_t stream)
{
    static std::atomic<int> occupancy[kMaxDevices];
    auto kernel = qkNormRopeGeneralKernel<T>;
    int64_t const target = static_cast<int64_t>(blocksPerSm(kernel, device, occupancy)) * smCount(device);
    int64_t const totalRows = a.numTokens * 2 * static_cast<int64_t>(a.numHeads);
    int64_t gridX = ceilDiv(totalRows, kWarpsPerBlock);
    int64_t const maxGridX = target * 16;
    gridX = gridX < maxGridX ? gridX : maxGridX;
    return launchKernel(kernel, dim3(static_cast<unsigned>(gridX)), dim3(kThreads), stream, a, interleaved);
}

bool aligned16(void const* p)
{
    return (reinterpret_cast<uintptr_t>(p) & 15U) == 0;
}

template <typename T>
cudaError_t dispatch(KernelArgs const& a, bool interleaved, int device, cudaStream_t stream)
{
    using Storage = typename T::Storage;
    constexpr int kVec = 16 / static_cast<int>(sizeof(Storage));
    bool const aligned = aligned16(a.q) && aligned16(a.k) && aligned16(a.qOut) && aligned16(a.kOut)
        && aligned16(a.qWeight) && aligned16(a.kWeight);
    int const half = a.rotaryDim / 2;
    bool const neoxOk = half % kVec == 0;
    if (aligned)
    {
        switch (a.headDim)
        {
        case 64:
            if (interleaved)
                return launchFast<T, 64, true>(a, device, stream);
            if (neoxOk && (FastConfig<T, 64>::kNV == 1 || a.rotaryDim == 64))
                return launchFast<T, 64, false>(a, device, stream);
            break;
        case 128:
            if (interleaved)
                return launchFast<T, 128, true>(a, device, stream);
            if (neoxOk && (FastConfig<T, 128>::kNV == 1 || a.rotaryDim == 128))
                return launchFast<T, 128, false>(a, device, stream);
            break;
        case 256:
            if (interleaved)
                return launchFast<T, 256, true>(a, device, stream);
            if (neoxOk && (FastConfig<T, 256>::kNV == 1 || a.rotaryDim == 256))
                return launchFast<T, 256, false>(a, device, stream);
            break;
        default: break;
        }
    }
    return launchGeneral<T>(a, interleaved, device, stream);
}

} // namespace

Status launchQKNormRoPE(QKNormRoPEParams const& p, cudaStream_t stream) noexcept
{
    Status const s = checkParams(p);
    if (s != Status::kSUCCESS)
    {
        return s;
    }
    if (p.batch == 0 || p.seqLen == 0 || p.numHeads == 0)
    {
        return Status::kSUCCESS;
    }
    // 2 * num_heads rows per token are indexed with int32 inside a token.
    if (p.numHeads > (int64_t{1} << 29))
    {
        return Status::kBAD_SHAPE;
    }
    KernelArgs a{};
    a.q = p.q;
    a.k = p.k;
    a.qWeight = p.qWeight;
    a.kWeight = p.kWeight;
    a.cache = p.cache;
    a.qOut = p.qOut;
    a.kOut = p.kOut;
    a.numTokens = p.batch * p.seqLen;
    a.seqLen = p.seqLen;
    a.numHeads = static_cast<int32_t>(p.numHeads);
    a.headDim = static_cast<int32_t>(p.headDim);
    a.rotaryDim = static_cast<int32_t>(p.rotaryDim);
    a.rowsPerSplit = 0;
    a.eps = p.eps;
    a.rounding = p.rounding;

    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess)
    {
        return Status::kCUDA_ERROR;
    }
    cudaError_t err = cudaSuccess;
    switch (p.dtype)
    {
    case DataType::kFLOAT32: err = dispatch<Fp32>(a, p.interleaved, device, stream); break;
    case DataType::kFLOAT16: err = dispatch<Fp16>(a, p.interleaved, device, stream); break;
    case DataType::kBFLOAT16: err = dispatch<Bf16>(a, p.interleaved, device, stream); break;
    }
    return err == cudaSuccess ? Status::kSUCCESS : Status::kCUDA_ERROR;
}

} // namespace qkrope
