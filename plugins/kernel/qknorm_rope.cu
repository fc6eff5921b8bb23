// qkrope: the fused QK-RMSNorm + RoPE CUDA kernel (docs/spec.md section 3) and its launcher.
//
// The op is memory-bound (per element: read 2 or 4 bytes, write as many, ~12 fp32 operations), so
// the design is about keeping enough bytes in flight and issuing few instructions per element.
//
// Work decomposition (both paths). A "row group" of threads owns one (token, head) row at a time;
// a work unit is `rows` consecutive heads of q or of k of one token. Each group has a fixed slot
// (q or k, which heads) for the whole kernel and walks tokens with a fixed stride, so
//   - its weight elements (q's or k's) are loaded and converted once, into registers;
//   - no division or q/k selection happens per row or per token;
//   - the grid holds a whole number of tokens (splitTokens): `tokenStep` tokens are in flight at
//     once and every group does the same number of tokens, +-1. With at most one unit per group
//     in flight this keeps every SM busy down to a few hundred tokens (Qwen-Image's 512-token
//     text stream and the 1024-token 512x512 image included): the launch plan (planFast in
//     qknorm_rope_plan.h) picks the rows per unit from a model of the device: issue time vs the
//     bandwidth that its bytes in flight sustain (Little's law), with wave quantisation.
//
// Fast path (head_dim 64/128/256, q/k/outputs 16-byte aligned; qknorm_rope_plan.h): a row group is
// head_dim / (elements per 128 bits) threads (<= 32), each owning whole 128-bit chunks of the row.
//   - software pipeline in shared memory, prefetch distance kPrefetch = 2 tokens over a ring of
//     kStages = 3 stages: each token first issues the asynchronous 16-byte copies (cp.async,
//     through __pipeline_memcpy_async: LDGSTS in the SASS) of the rows two tokens ahead into the
//     stage the previous token was read from, commits them as one group, and waits with
//     cp.async.wait_group kPrefetch (__pipeline_wait_prior): only the oldest group, its own rows,
//     is retired, the next two tokens' rows stay in flight. Register loads could not do this:
//     ptxas puts every global load of the loop on one scoreboard and the first use of cos/sin
//     waits for all of it, the rows two tokens ahead included (issue 31; docs/spec.md 3.6). The
//     waits are read from the SASS control bits (qkrope.apps.kernel_report.sass.scoreboards,
//     scripts/kernel_report.py): past every wait kPrefetch x rows x 16 B per thread are still
//     outstanding. Each thread copies and reads only its own slots of the ring, so no barrier
//     is needed: wait_group makes a thread's own copies visible to it, and the stage a token's
//     copies overwrite was read (into registers, consumed) by the previous token, earlier in
//     program order;
//   - sum of squares by fused multiply-adds, reduced with xor shuffles inside the group, all rows
//     of a unit interleaved; 1/D is an exact multiplication (power-of-two D);
//   - rounding mode, pairing and full/partial rotary are template parameters, so the Qwen-Image
//     instance carries no per-element selects; bf16/fp16 pack two elements per conversion and
//     canonicalise NaNs only when a row produced one (one predicate per pair on the common path);
//   - NeoX partners in other lanes come through __shfl_sync relative to the row group; the
//     partner's sign is folded into the sin values once per token;
//   - outputs are stored with the default cache policy (the attention kernel reads them next).
// General path (any even head_dim <= 512, any alignment): a warp owns a row, each lane element
// pairs lane, lane + 32, ...; NeoX pairs are exchanged through shared memory.
//
// Launches go through launchKernel (cudaLaunchKernel): a launch reports its own status, never an
// error left behind by earlier work. The SIMT emulation (plugins/simt) provides the same runtime
// entry points, which is how this unchanged source runs on a CPU in CI.
//
// All index arithmetic that can exceed 2^31 is int64 (checkParams keeps a token's heads x
// head_dim below 2^31, which is indexed with int32).
#include "qknorm_rope.h"
#include "qknorm_rope_math.h"
#include "qknorm_rope_plan.h"

#include <cuda_pipeline_primitives.h>
#include <cuda_runtime.h>

#include <atomic>
#include <mutex>
#include <cstdint>
#include <cstring>
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
constexpr int kMaxRows = kPlanMaxRows;   // rows per work unit of the fast path: 1..maxRows() <= kMaxRows
constexpr int kFastMinBlocks = 2;        // >= 512 resident threads per SM (<= 128 registers)
constexpr int kPrefetch = kPlanPrefetch; // fast path: tokens whose row loads are in flight ahead of use
static_assert(kThreads == kPlanThreads, "the launch plan models this block size");
static_assert(sizeof(kFastIssueCost) / sizeof(kFastIssueCost[0]) == math::kRoundingModes,
    "the launch plan has an instruction cost per rounding mode");
constexpr int kStages = kPrefetch + 1;   // fast path: the shared-memory ring's stages
static_assert(kPrefetch == 2, "the token loop rotates kPrefetch + 1 = 3 ring stages");
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
    int64_t tokenStep; // tokens between two consecutive tokens of one row group (splitTokens)
    int64_t seqStep;   // tokenStep % seqLen
    // Fast path, loop-invariant strides precomputed by the launcher: kernel parameters live in the
    // constant bank, which instructions read as operands, so they hold no registers across the
    // token loop (with 128 registers per thread at kFastMinBlocks, two 64-bit values held there
    // were what made the partial-rotary rows-2 instances spill on sm_100).
    int64_t stepElems;  // tokenStep x numHeads x headDim: elements between a group's tokens
    int64_t trigStep;   // seqStep x rotaryDim: cache floats between a group's tokens
    int64_t trigWrap;   // seqLen x rotaryDim: the cache's floats (a wrap past its last row)
    int32_t numHeads;
    int32_t headDim;
    int32_t rotaryDim;
    int32_t unitsPerToken; // row-group slots per token: 2 (q, k) x units per tensor
    int32_t rowElems;      // norm_scope 1: numHeads x headDim, the values one RMS spans
    float eps;
    int32_t rounding;  // general path only (a template parameter of the fast path)
    bool interleaved;  // general path only
    bool weightsFp32;  // q/k weights are float32 (else the activation type): read once per row set
};

template <typename To, typename From>
__device__ __forceinline__ To bitCast(From const& from)
{
    static_assert(sizeof(To) == sizeof(From), "same size");
    To to;
    memcpy(&to, &from, sizeof(To));
    return to;
}

// Weight element i as fp32: the weights are in the activation type T or, with weightsFp32, float32
// (docs/spec.md section 3.4). A uniform per-element select, not a branch around two load loops:
// measured on the sm_90/sm_100 SASS, the two-loop form spilled on sm_100 and grew the prologue
// more. The kernels read their weights once per row set, outside the token loop (the general
// row kernel once per head and token, as it always reloaded them), so the token loop is unchanged.
template <typename T>
__device__ __forceinline__ float loadWeight(void const* weights, int64_t i, bool weightsFp32)
{
    return weightsFp32 ? __ldg(static_cast<float const*>(weights) + i)
                       : T::toFloat(__ldg(static_cast<typename T::Storage const*>(weights) + i));
}

// ---------------------------------------------------------------------------------------------
// 128-bit chunks <-> fp32, per element type. pack2 is the hardware conversion (round to nearest
// even; a NaN becomes 0x7FFF, canonicalised by the caller); unpack of bf16 is a shift/mask.
template <typename T>
struct Chunk;

template <>
struct Chunk<Fp32>
{
    __device__ __forceinline__ static void unpack(uint4 const r, float* out)
    {
        out[0] = __uint_as_float(r.x);
        out[1] = __uint_as_float(r.y);
        out[2] = __uint_as_float(r.z);
        out[3] = __uint_as_float(r.w);
    }
    __device__ __forceinline__ static uint4 pack(float const* in, unsigned& /*nan*/)
    {
        return make_uint4(__float_as_uint(in[0]), __float_as_uint(in[1]), __float_as_uint(in[2]),
            __float_as_uint(in[3]));
    }
};

constexpr uint32_t kHardwareNaN = 0x7FFFU; // what cvt.rn.{bf16,f16}.f32 returns for a NaN

template <typename T>
struct Chunk16
{
    __device__ __forceinline__ static void unpack(uint4 const r, float* out)
    {
        uint32_t const words[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
        for (int i = 0; i < 4; ++i)
        {
            T::unpack2(words[i], out[2 * i], out[2 * i + 1]);
        }
    }
    // Hardware conversion: a NaN becomes 0x7FFF (never the result of a non-NaN value). `nan`
    // records that one was packed, one predicate per pair; the kernel canonicalises afterwards.
    __device__ __forceinline__ static uint4 pack(float const* in, unsigned& nan)
    {
        uint32_t words[4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
        {
            words[i] = T::pack2(in[2 * i], in[2 * i + 1]);
            nan |= (in[2 * i] != in[2 * i]) || (in[2 * i + 1] != in[2 * i + 1]) ? 1U : 0U;
        }
        return make_uint4(words[0], words[1], words[2], words[3]);
    }
    // The halves of a chunk that hold the hardware NaN, replaced by torch's canonical NaN.
    __device__ __forceinline__ static uint4 canonicalNaNs(uint4 const r)
    {
        uint32_t words[4] = {r.x, r.y, r.z, r.w};
#pragma unroll
        for (int i = 0; i < 4; ++i)
        {
            uint32_t const lo = words[i] & 0xFFFFU;
            uint32_t const hi = words[i] >> 16;
            words[i] = (lo == kHardwareNaN ? T::kCanonicalNaN : lo)
                | ((hi == kHardwareNaN ? T::kCanonicalNaN : hi) << 16);
        }
        return make_uint4(words[0], words[1], words[2], words[3]);
    }
    // Round a pair to the element type and back (rounding = 1 and 2); NaN payloads do not matter
    // here.
    __device__ __forceinline__ static void round2(float& a, float& b)
    {
        T::unpack2(T::pack2(a, b), a, b);
    }
};

struct Bf16Ops
{
    static constexpr uint32_t kCanonicalNaN = math::kBf16CanonicalNaN;
    __device__ __forceinline__ static void unpack2(uint32_t const w, float& lo, float& hi)
    {
        lo = __uint_as_float(w << 16);
        hi = __uint_as_float(w & 0xFFFF0000U);
    }
    __device__ __forceinline__ static uint32_t pack2(float const lo, float const hi)
    {
        return bitCast<uint32_t>(__floats2bfloat162_rn(lo, hi));
    }
};

struct Fp16Ops
{
    static constexpr uint32_t kCanonicalNaN = math::kFp16CanonicalNaN;
    __device__ __forceinline__ static void unpack2(uint32_t const w, float& lo, float& hi)
    {
        float2 const f = __half22float2(bitCast<__half2>(w));
        lo = f.x;
        hi = f.y;
    }
    __device__ __forceinline__ static uint32_t pack2(float const lo, float const hi)
    {
        return bitCast<uint32_t>(__floats2half2_rn(lo, hi));
    }
};

template <>
struct Chunk<Bf16> : Chunk16<Bf16Ops>
{
};

template <>
struct Chunk<Fp16> : Chunk16<Fp16Ops>
{
};

// ---------------------------------------------------------------------------------------------
// Fast path.
// kernel-report: qkNormRopeFastKernel<T, HEAD_DIM, INTERLEAVED, ROWS, ROUNDING, FULL_ROTARY>
template <typename T, int HEAD_DIM, bool INTERLEAVED, int ROWS, int ROUNDING, bool FULL_ROTARY>
__global__ void __launch_bounds__(kThreads, kFastMinBlocks) qkNormRopeFastKernel(KernelArgs const a)
{
    using Storage = typename T::Storage;
    using Ch = Chunk<T>;
    constexpr int kBytes = static_cast<int>(sizeof(Storage));
    constexpr int kVec = fastVec(kBytes);
    constexpr int kLanes = fastLanes(HEAD_DIM, kBytes);
    constexpr int kNV = fastChunksPerThread(HEAD_DIM, kBytes);
    constexpr int kElems = kNV * kVec;
    constexpr int kGroups = kThreads / kLanes;
    // cos/sin values per thread and token: one per pair (interleaved), one per element of the
    // first chunk (NeoX: with two chunks per thread the second holds the partners), in runs of
    // consecutive cache columns, one run per chunk (interleaved) or one run (NeoX).
    constexpr int kTrig = INTERLEAVED ? kElems / 2 : kVec;
    constexpr int kRuns = INTERLEAVED ? kNV : 1;
    constexpr int kRun = kTrig / kRuns;
    static_assert(ROWS >= 1 && ROWS <= kMaxRows, "rows per unit");
    static_assert(kNV == 1 || kNV == 2, "one or two chunks per thread");
    static_assert(INTERLEAVED || kNV == 1 || FULL_ROTARY, "NeoX with two chunks pairs up only at full rotary");
    static_assert(ROUNDING >= 0 && ROUNDING < math::kRoundingModes, "rounding mode");
    static_assert(ROUNDING == math::kRoundingOne || !T::kIsFloat32, "fp32 has one rounding mode");

    int const lane = static_cast<int>(threadIdx.x) % kLanes;
    int64_t const group = static_cast<int64_t>(blockIdx.x) * kGroups + static_cast<int>(threadIdx.x) / kLanes;
    int const units = a.unitsPerToken;
    int const slot = static_cast<int>(group % units);
    int64_t t = group / units;
    bool const isQ = slot < units / 2;
    int const headBase = (isQ ? slot : slot - units / 2) * ROWS;
    int const numHeads = a.numHeads;
    int const rot = a.rotaryDim;
    int const half = rot / 2;

    // Element index of element i of this thread's chunk v.
    auto elem = [lane](int v, int i) { return (v * kLanes + lane) * kVec + i; };

    Storage const* const src = static_cast<Storage const*>(isQ ? a.q : a.k);
    Storage* const dst = static_cast<Storage*>(isQ ? a.qOut : a.kOut);

    // The weights, once for the whole kernel (scalar loads: they need no alignment).
    float w[kElems];
    {
        void const* const weight = isQ ? a.qWeight : a.kWeight;
#pragma unroll
        for (int v = 0; v < kNV; ++v)
        {
#pragma unroll
            for (int i = 0; i < kVec; ++i)
            {
                w[v * kVec + i] = loadWeight<T>(weight, elem(v, i), a.weightsFp32);
            }
        }
    }

    // The unit's rows inside a token. When ROWS does not divide the head count, the last unit
    // repeats the last head: loaded (in bounds), never stored.
    int rowOffset[ROWS];
    unsigned stored = 0;
#pragma unroll
    for (int u = 0; u < ROWS; ++u)
    {
        int const h = headBase + u;
        rowOffset[u] = (h < numHeads ? h : numHeads - 1) * HEAD_DIM + elem(0, 0);
        stored |= (h < numHeads ? 1U : 0U) << u;
    }

    // cos/sin columns: run r starts at trigBase[r]. NeoX: a chunk is all first-half elements
    // (partner + half, sin negated), all second-half, or, past rotary_dim, passed through.
    int trigBase[kRuns];
    bool runRotated[kRuns];
#pragma unroll
    for (int r = 0; r < kRuns; ++r)
    {
        int const e = elem(r, 0);
        trigBase[r] = INTERLEAVED ? e / 2 : (e < half ? e : e - half);
        runRotated[r] = e < rot;
    }
    int const e0 = elem(0, 0);
    bool const neoxFirst = !INTERLEAVED && kNV == 1 && e0 < half;
    int const partner = neoxFirst ? lane + half / kVec : (e0 < rot ? lane - half / kVec : lane);
    // Partial rotary: a 128-bit chunk is rotated entirely or passed through entirely (selectPath:
    // rotary_dim a multiple of 8 >= kVec, chunks start at multiples of kVec), and chunk v is run v
    // (interleaved: one run per chunk; NeoX at partial rotary: one chunk), so runRotated[v] selects
    // per chunk: one predicate per chunk, not a mask bit tested per element.
    static_assert(FULL_ROTARY || kRuns == kNV, "partial rotary: one cos/sin run per chunk");

    // The ring: stage s, chunk c of this thread at ring[s][c][threadIdx.x] (consecutive threads
    // on consecutive 16 bytes: conflict-free 128-bit shared accesses). Static shared memory:
    // kStages x ROWS x kNV x 16 B x kThreads <= 48 KiB (fastMaxRows).
    __shared__ __align__(16) uint4 ring[kStages][ROWS * kNV][kThreads];
    static_assert(sizeof(ring) <= 48 * 1024, "static shared memory: at most 48 KiB per block");
    int const tid = static_cast<int>(threadIdx.x);
    auto issueRows = [&](Storage const* const token, int const stage) {
#pragma unroll
        for (int u = 0; u < ROWS; ++u)
        {
#pragma unroll
            for (int v = 0; v < kNV; ++v)
            {
                __pipeline_memcpy_async(&ring[stage][u * kNV + v][tid], token + rowOffset[u] + v * kLanes * kVec,
                    sizeof(uint4));
            }
        }
    };
    auto readRows = [&](int const stage, uint4 (&raw)[ROWS][kNV]) {
#pragma unroll
        for (int u = 0; u < ROWS; ++u)
        {
#pragma unroll
            for (int v = 0; v < kNV; ++v)
            {
                raw[u][v] = ring[stage][u * kNV + v][tid];
            }
        }
    };
    // cos/sin of one token: 16-byte aligned runs (selectPath: cache 16-byte aligned, rotary half a
    // multiple of 4), each rotated entirely or not at all.
    auto loadTrig = [&](float const* const row, float (&cosv)[kTrig], float (&sinv)[kTrig]) {
#pragma unroll
        for (int r = 0; r < kRuns; ++r)
        {
            float* const c = cosv + r * kRun;
            float* const n = sinv + r * kRun;
#pragma unroll
            for (int m = 0; m < kRun; m += (kRun >= 4 ? 4 : 2))
            {
                if constexpr (kRun >= 4)
                {
                    float4 cv = make_float4(1.0F, 1.0F, 1.0F, 1.0F);
                    float4 nv = make_float4(0.0F, 0.0F, 0.0F, 0.0F);
                    if (FULL_ROTARY || runRotated[r])
                    {
                        cv = __ldg(reinterpret_cast<float4 const*>(row + trigBase[r] + m));
                        nv = __ldg(reinterpret_cast<float4 const*>(row + half + trigBase[r] + m));
                    }
                    c[m] = cv.x, c[m + 1] = cv.y, c[m + 2] = cv.z, c[m + 3] = cv.w;
                    n[m] = nv.x, n[m + 1] = nv.y, n[m + 2] = nv.z, n[m + 3] = nv.w;
                }
                else
                {
                    float2 cv = make_float2(1.0F, 1.0F);
                    float2 nv = make_float2(0.0F, 0.0F);
                    if (FULL_ROTARY || runRotated[r])
                    {
                        cv = __ldg(reinterpret_cast<float2 const*>(row + trigBase[r] + m));
                        nv = __ldg(reinterpret_cast<float2 const*>(row + half + trigBase[r] + m));
                    }
                    c[m] = cv.x, c[m + 1] = cv.y;
                    n[m] = nv.x, n[m + 1] = nv.y;
                }
            }
            if (neoxFirst)
            {
#pragma unroll
                for (int m = 0; m < kRun; ++m)
                {
                    n[m] = -n[m]; // a*c - b*n == a*c + b*(-n), exactly
                }
            }
        }
    };

    // Walk this group's tokens with pointers (no per-token multiplications): token t, t + step, ...
    int64_t const tokenElems = static_cast<int64_t>(numHeads) * HEAD_DIM;
    int64_t const stepElems = a.stepElems;
    int64_t remaining = t < a.numTokens ? (a.numTokens - t + a.tokenStep - 1) / a.tokenStep : 0;
    Storage const* in = src + t * tokenElems;
    Storage* out = dst + t * tokenElems;
    float const* trig = a.cache + (t < a.numTokens ? t % a.seqLen : 0) * rot;
    float const* const trigEnd = a.cache + a.trigWrap;
    int64_t const trigStep = a.trigStep;
    int64_t const trigWrap = a.trigWrap;
    unsigned packedNaN = 0;

    // One token, its rows in ring stage STAGE: issue the copies of the token kPrefetch steps ahead
    // into stage STAGE + kPrefetch (mod kStages: the stage the previous token was read from) and
    // commit them as one group (an empty group past the last tokens, so the count below holds:
    // one commit per token, unconditional),
    // fetch this token's cos/sin, wait until all but the kPrefetch newest groups have landed (this
    // token's own), read the rows, then normalise, rotate and store. The stage is a compile-time
    // constant (the loop is unrolled over the ring), so the ring's addresses are immediates.
    auto token = [&](auto stageTag) {
        constexpr int kStage = decltype(stageTag)::value;
        constexpr int kAhead = (kStage + kPrefetch) % kStages;
        if (remaining > kPrefetch)
        {
            issueRows(in + kPrefetch * stepElems, kAhead);
        }
        __pipeline_commit();
        float cosv[kTrig];
        float sinv[kTrig];
        loadTrig(trig, cosv, sinv);
        __pipeline_wait_prior(kPrefetch);
        uint4 cur[ROWS][kNV];
        readRows(kStage, cur);

        // Sum of squares of every row, the rows' reductions interleaved.
        float sumSq[ROWS];
#pragma unroll
        for (int u = 0; u < ROWS; ++u)
        {
            float x[kElems];
#pragma unroll
            for (int v = 0; v < kNV; ++v)
            {
                Ch::unpack(cur[u][v], x + v * kVec);
            }
            sumSq[u] = 0.0F;
#pragma unroll
            for (int i = 0; i < kElems; ++i)
            {
                sumSq[u] = math::fmaSquare(x[i], sumSq[u]);
            }
        }
#pragma unroll
        for (int offset = kLanes / 2; offset > 0; offset /= 2)
        {
#pragma unroll
            for (int u = 0; u < ROWS; ++u)
            {
                sumSq[u] = math::add(sumSq[u], __shfl_xor_sync(kFullMask, sumSq[u], offset, kLanes));
            }
        }

#pragma unroll
        for (int u = 0; u < ROWS; ++u)
        {
            float const inv = math::rmsInvPow2<HEAD_DIM>(sumSq[u], a.eps);
            float x[kElems];
#pragma unroll
            for (int v = 0; v < kNV; ++v)
            {
                Ch::unpack(cur[u][v], x + v * kVec);
            }
            float y[kElems];
#pragma unroll
            for (int i = 0; i < kElems; i += 2)
            {
                float n0 = math::mul(x[i], inv);
                float n1 = math::mul(x[i + 1], inv);
                if constexpr (ROUNDING == math::kRoundingDiffusers)
                {
                    Ch::round2(n0, n1);
                }
                n0 = math::mul(n0, w[i]);
                n1 = math::mul(n1, w[i + 1]);
                if constexpr (ROUNDING != math::kRoundingOne)
                {
                    Ch::round2(n0, n1); // diffusers' and FLUX's orders round x * inv * w
                }
                y[i] = n0;
                y[i + 1] = n1;
            }

            float o[kElems];
            if constexpr (INTERLEAVED)
            {
#pragma unroll
                for (int p = 0; p < kElems / 2; ++p)
                {
                    o[2 * p] = math::rotateFirst(y[2 * p], y[2 * p + 1], cosv[p], sinv[p]);
                    o[2 * p + 1] = math::rotateSecond(y[2 * p], y[2 * p + 1], cosv[p], sinv[p]);
                }
            }
            else if constexpr (kNV == 1)
            {
#pragma unroll
                for (int i = 0; i < kElems; ++i)
                {
                    // every lane of the group takes part (pass-through lanes fetch their own value)
                    float const other = __shfl_sync(kFullMask, y[i], partner, kLanes);
                    // first half: y*c - other*n (sin negated); second half: other*n + y*c
                    o[i] = math::add(math::mul(y[i], cosv[i]), math::mul(other, sinv[i]));
                }
            }
            else
            {
#pragma unroll
                for (int i = 0; i < kVec; ++i)
                {
                    o[i] = math::rotateFirst(y[i], y[kVec + i], cosv[i], sinv[i]);
                    o[kVec + i] = math::rotateSecond(y[i], y[kVec + i], cosv[i], sinv[i]);
                }
            }
            if constexpr (!FULL_ROTARY)
            {
#pragma unroll
                for (int v = 0; v < kNV; ++v)
                {
#pragma unroll
                    for (int i = v * kVec; i < (v + 1) * kVec; ++i)
                    {
                        o[i] = runRotated[v] ? o[i] : y[i];
                    }
                }
            }

            if ((stored >> u) & 1U)
            {
#pragma unroll
                for (int v = 0; v < kNV; ++v)
                {
                    *reinterpret_cast<uint4*>(out + rowOffset[u] + v * kLanes * kVec)
                        = Ch::pack(o + v * kVec, packedNaN);
                }
            }
        }

        in += stepElems;
        out += stepElems;
        trig += trigStep;
        trig = trig >= trigEnd ? trig - trigWrap : trig;
        --remaining;
    };

    // Prologue: the first kPrefetch tokens' rows in flight (one group each, empty past the last
    // token) before any is used. Each token of the loop then issues the copies of the token
    // kPrefetch ahead and retires only its own group, so past every wait the next kPrefetch
    // tokens' rows are still outstanding: kPrefetch x ROWS x kNV x 16 B per thread.
    if (remaining > 0)
    {
        issueRows(in, 0);
    }
    __pipeline_commit();
    if (remaining > 1)
    {
        issueRows(in + stepElems, 1);
    }
    __pipeline_commit();
    while (remaining > 0)
    {
        token(std::integral_constant<int, 0>{});
        if (remaining == 0)
        {
            break;
        }
        token(std::integral_constant<int, 1>{});
        if (remaining == 0)
        {
            break;
        }
        token(std::integral_constant<int, 2>{});
    }

    // Rare: a row produced a NaN (NaN or inf inputs, weights or cache). Give the halves this
    // thread stored torch's canonical NaN, outside the hot loop. Only this thread wrote them.
    if constexpr (!T::kIsFloat32)
    {
        if (__builtin_expect(packedNaN != 0, 0))
        {
            for (int64_t tt = group / units; tt < a.numTokens; tt += a.tokenStep)
            {
                Storage* const row = dst + tt * tokenElems;
#pragma unroll
                for (int u = 0; u < ROWS; ++u)
                {
#pragma unroll
                    for (int v = 0; v < kNV; ++v)
                    {
                        if ((stored >> u) & 1U)
                        {
                            uint4* const chunk = reinterpret_cast<uint4*>(row + rowOffset[u] + v * kLanes * kVec);
                            *chunk = Ch::canonicalNaNs(*chunk);
                        }
                    }
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Fast path, norm_scope 1: one block owns a token's whole q or k row (num_heads x HEAD_DIM values)
// and walks tokens with a fixed stride. The block is blockDim.x = rowThreads(...) threads: groups of
// kLanes threads as in the per-head kernel, group g owning heads g*ROWS .. g*ROWS+ROWS-1 (heads past
// num_heads are neither read nor stored), each thread its 128-bit chunks of them. The token loop is
// the per-head kernel's: the same cp.async ring (prefetch distance kPrefetch), cos/sin vectors,
// arithmetic and stores. The RMS spans the row: each head's sum of squares is reduced inside its
// group (the per-head order), written to shared memory, and after one __syncthreads every warp adds
// the head sums in math::rowSumSquares' order (head h into lane h % 32, then a butterfly), so the
// row's sum does not depend on ROWS or the block size and the CPU build reproduces it. The head sums
// have one shared-memory slot per ring stage: a slot is rewritten three tokens later, past two
// barriers every thread has reached after reading it. The weights ([num_heads x HEAD_DIM]) are
// loaded once per thread, ROWS x its chunks, into registers.
// kernel-report: qkNormRopeRowKernel<T, HEAD_DIM, INTERLEAVED, ROWS, ROUNDING, FULL_ROTARY>
template <typename T, int HEAD_DIM, bool INTERLEAVED, int ROWS, int ROUNDING, bool FULL_ROTARY>
__global__ void __launch_bounds__(kPlanRowMaxThreads, kFastMinBlocks) qkNormRopeRowKernel(KernelArgs const a)
{
    using Storage = typename T::Storage;
    using Ch = Chunk<T>;
    constexpr int kBytes = static_cast<int>(sizeof(Storage));
    constexpr int kVec = fastVec(kBytes);
    constexpr int kLanes = fastLanes(HEAD_DIM, kBytes);
    constexpr int kNV = fastChunksPerThread(HEAD_DIM, kBytes);
    constexpr int kElems = kNV * kVec;
    constexpr int kTrig = INTERLEAVED ? kElems / 2 : kVec;
    constexpr int kRuns = INTERLEAVED ? kNV : 1;
    constexpr int kRun = kTrig / kRuns;
    constexpr int kMaxThreads = rowMaxThreads(ROWS * kNV);
    constexpr int kMaxHeads = kMaxThreads / kLanes * ROWS;
    constexpr int kSumsPerLane = (kMaxHeads + 31) / 32;
    static_assert(ROWS >= 1 && ROWS <= rowMaxRows(HEAD_DIM, kBytes, INTERLEAVED, FULL_ROTARY, ROUNDING), "rows per group");
    static_assert(kNV == 1 || kNV == 2, "one or two chunks per thread");
    static_assert(INTERLEAVED || kNV == 1 || FULL_ROTARY, "NeoX with two chunks pairs up only at full rotary");
    static_assert(ROUNDING >= 0 && ROUNDING < math::kRoundingModes, "rounding mode");
    static_assert(ROUNDING == math::kRoundingOne || !T::kIsFloat32, "fp32 has one rounding mode");
    static_assert(FULL_ROTARY || kRuns == kNV, "partial rotary: one cos/sin run per chunk");

    int const tid = static_cast<int>(threadIdx.x);
    int const lane = tid % kLanes;
    int const warpLane = tid % 32;
    bool const isQ = blockIdx.x % 2 == 0;
    int64_t t = blockIdx.x / 2;
    int const numHeads = a.numHeads;
    int const rot = a.rotaryDim;
    int const half = rot / 2;
    int const headBase = tid / kLanes * ROWS;

    auto elem = [lane](int v, int i) { return (v * kLanes + lane) * kVec + i; };

    Storage const* const src = static_cast<Storage const*>(isQ ? a.q : a.k);
    Storage* const dst = static_cast<Storage*>(isQ ? a.qOut : a.kOut);

    // This thread's rows (heads) and their weights, once for the whole kernel.
    int rowOffset[ROWS];
    unsigned stored = 0;
    float w[ROWS][kElems];
    {
        void const* const weight = isQ ? a.qWeight : a.kWeight;
#pragma unroll
        for (int u = 0; u < ROWS; ++u)
        {
            int const h = headBase + u;
            int const hh = h < numHeads ? h : numHeads - 1;
            rowOffset[u] = hh * HEAD_DIM + elem(0, 0);
            stored |= (h < numHeads ? 1U : 0U) << u;
#pragma unroll
            for (int v = 0; v < kNV; ++v)
            {
#pragma unroll
                for (int i = 0; i < kVec; ++i)
                {
                    w[u][v * kVec + i] = loadWeight<T>(weight, hh * HEAD_DIM + elem(v, i), a.weightsFp32);
                }
            }
        }
    }

    int trigBase[kRuns];
    bool runRotated[kRuns];
#pragma unroll
    for (int r = 0; r < kRuns; ++r)
    {
        int const e = elem(r, 0);
        trigBase[r] = INTERLEAVED ? e / 2 : (e < half ? e : e - half);
        runRotated[r] = e < rot;
    }
    int const e0 = elem(0, 0);
    bool const neoxFirst = !INTERLEAVED && kNV == 1 && e0 < half;
    int const partner = neoxFirst ? lane + half / kVec : (e0 < rot ? lane - half / kVec : lane);

    __shared__ __align__(16) uint4 ring[kStages][ROWS * kNV][kMaxThreads];
    __shared__ float headSums[kStages][kMaxHeads];
    static_assert(sizeof(ring) + sizeof(headSums) <= 48 * 1024, "static shared memory: at most 48 KiB per block");
    auto issueRows = [&](Storage const* const token, int const stage) {
#pragma unroll
        for (int u = 0; u < ROWS; ++u)
        {
            if ((stored >> u) & 1U)
            {
#pragma unroll
                for (int v = 0; v < kNV; ++v)
                {
                    __pipeline_memcpy_async(&ring[stage][u * kNV + v][tid], token + rowOffset[u] + v * kLanes * kVec,
                        sizeof(uint4));
                }
            }
        }
    };
    auto loadTrig = [&](float const* const row, float (&cosv)[kTrig], float (&sinv)[kTrig]) {
#pragma unroll
        for (int r = 0; r < kRuns; ++r)
        {
            float* const c = cosv + r * kRun;
            float* const n = sinv + r * kRun;
#pragma unroll
            for (int m = 0; m < kRun; m += (kRun >= 4 ? 4 : 2))
            {
                if constexpr (kRun >= 4)
                {
                    float4 cv = make_float4(1.0F, 1.0F, 1.0F, 1.0F);
                    float4 nv = make_float4(0.0F, 0.0F, 0.0F, 0.0F);
                    if (FULL_ROTARY || runRotated[r])
                    {
                        cv = __ldg(reinterpret_cast<float4 const*>(row + trigBase[r] + m));
                        nv = __ldg(reinterpret_cast<float4 const*>(row + half + trigBase[r] + m));
                    }
                    c[m] = cv.x, c[m + 1] = cv.y, c[m + 2] = cv.z, c[m + 3] = cv.w;
                    n[m] = nv.x, n[m + 1] = nv.y, n[m + 2] = nv.z, n[m + 3] = nv.w;
                }
                else
                {
                    float2 cv = make_float2(1.0F, 1.0F);
                    float2 nv = make_float2(0.0F, 0.0F);
                    if (FULL_ROTARY || runRotated[r])
                    {
                        cv = __ldg(reinterpret_cast<float2 const*>(row + trigBase[r] + m));
                        nv = __ldg(reinterpret_cast<float2 const*>(row + half + trigBase[r] + m));
                    }
                    c[m] = cv.x, c[m + 1] = cv.y;
                    n[m] = nv.x, n[m + 1] = nv.y;
                }
            }
            if (neoxFirst)
            {
#pragma unroll
                for (int m = 0; m < kRun; ++m)
                {
                    n[m] = -n[m];
                }
            }
        }
    };

    int64_t const tokenElems = static_cast<int64_t>(numHeads) * HEAD_DIM;
    int64_t const stepElems = a.stepElems;
    int64_t remaining = t < a.numTokens ? (a.numTokens - t + a.tokenStep - 1) / a.tokenStep : 0;
    Storage const* in = src + t * tokenElems;
    Storage* out = dst + t * tokenElems;
    float const* trig = a.cache + (t < a.numTokens ? t % a.seqLen : 0) * rot;
    float const* const trigEnd = a.cache + a.trigWrap;
    int64_t const trigStep = a.trigStep;
    int64_t const trigWrap = a.trigWrap;
    unsigned packedNaN = 0;

    auto token = [&](auto stageTag) {
        constexpr int kStage = decltype(stageTag)::value;
        constexpr int kAhead = (kStage + kPrefetch) % kStages;
        if (remaining > kPrefetch)
        {
            issueRows(in + kPrefetch * stepElems, kAhead);
        }
        __pipeline_commit();
        float cosv[kTrig];
        float sinv[kTrig];
        loadTrig(trig, cosv, sinv);
        __pipeline_wait_prior(kPrefetch);
        uint4 cur[ROWS][kNV];
#pragma unroll
        for (int u = 0; u < ROWS; ++u)
        {
#pragma unroll
            for (int v = 0; v < kNV; ++v)
            {
                cur[u][v] = ring[kStage][u * kNV + v][tid];
            }
        }

        // Each head's sum of squares (the per-head order), then the row's over the heads.
        float sumSq[ROWS];
#pragma unroll
        for (int u = 0; u < ROWS; ++u)
        {
            float x[kElems];
#pragma unroll
            for (int v = 0; v < kNV; ++v)
            {
                Ch::unpack(cur[u][v], x + v * kVec);
            }
            sumSq[u] = 0.0F;
#pragma unroll
            for (int i = 0; i < kElems; ++i)
            {
                sumSq[u] = math::fmaSquare(x[i], sumSq[u]);
            }
        }
#pragma unroll
        for (int offset = kLanes / 2; offset > 0; offset /= 2)
        {
#pragma unroll
            for (int u = 0; u < ROWS; ++u)
            {
                sumSq[u] = math::add(sumSq[u], __shfl_xor_sync(kFullMask, sumSq[u], offset, kLanes));
            }
        }
        if (lane == 0)
        {
#pragma unroll
            for (int u = 0; u < ROWS; ++u)
            {
                if ((stored >> u) & 1U)
                {
                    headSums[kStage][headBase + u] = sumSq[u];
                }
            }
        }
        __syncthreads();
        float rowSum = 0.0F;
#pragma unroll
        for (int m = 0; m < kSumsPerLane; ++m)
        {
            int const h = warpLane + 32 * m;
            if (h < numHeads)
            {
                rowSum = math::add(rowSum, headSums[kStage][h]);
            }
        }
#pragma unroll
        for (int offset = 16; offset > 0; offset /= 2)
        {
            rowSum = math::add(rowSum, __shfl_xor_sync(kFullMask, rowSum, offset));
        }
        float const inv = math::rmsInv(rowSum, a.rowElems, a.eps);

#pragma unroll
        for (int u = 0; u < ROWS; ++u)
        {
            float x[kElems];
#pragma unroll
            for (int v = 0; v < kNV; ++v)
            {
                Ch::unpack(cur[u][v], x + v * kVec);
            }
            float y[kElems];
#pragma unroll
            for (int i = 0; i < kElems; i += 2)
            {
                float n0 = math::mul(x[i], inv);
                float n1 = math::mul(x[i + 1], inv);
                if constexpr (ROUNDING == math::kRoundingDiffusers)
                {
                    Ch::round2(n0, n1);
                }
                n0 = math::mul(n0, w[u][i]);
                n1 = math::mul(n1, w[u][i + 1]);
                if constexpr (ROUNDING != math::kRoundingOne)
                {
                    Ch::round2(n0, n1);
                }
                y[i] = n0;
                y[i + 1] = n1;
            }

            float o[kElems];
            if constexpr (INTERLEAVED)
            {
#pragma unroll
                for (int p = 0; p < kElems / 2; ++p)
                {
                    o[2 * p] = math::rotateFirst(y[2 * p], y[2 * p + 1], cosv[p], sinv[p]);
                    o[2 * p + 1] = math::rotateSecond(y[2 * p], y[2 * p + 1], cosv[p], sinv[p]);
                }
            }
            else if constexpr (kNV == 1)
            {
#pragma unroll
                for (int i = 0; i < kElems; ++i)
                {
                    float const other = __shfl_sync(kFullMask, y[i], partner, kLanes);
                    o[i] = math::add(math::mul(y[i], cosv[i]), math::mul(other, sinv[i]));
                }
            }
            else
            {
#pragma unroll
                for (int i = 0; i < kVec; ++i)
                {
                    o[i] = math::rotateFirst(y[i], y[kVec + i], cosv[i], sinv[i]);
                    o[kVec + i] = math::rotateSecond(y[i], y[kVec + i], cosv[i], sinv[i]);
                }
            }
            if constexpr (!FULL_ROTARY)
            {
#pragma unroll
                for (int v = 0; v < kNV; ++v)
                {
#pragma unroll
                    for (int i = v * kVec; i < (v + 1) * kVec; ++i)
                    {
                        o[i] = runRotated[v] ? o[i] : y[i];
                    }
                }
            }

            if ((stored >> u) & 1U)
            {
#pragma unroll
                for (int v = 0; v < kNV; ++v)
                {
                    *reinterpret_cast<uint4*>(out + rowOffset[u] + v * kLanes * kVec)
                        = Ch::pack(o + v * kVec, packedNaN);
                }
            }
        }

        in += stepElems;
        out += stepElems;
        trig += trigStep;
        trig = trig >= trigEnd ? trig - trigWrap : trig;
        --remaining;
    };

    if (remaining > 0)
    {
        issueRows(in, 0);
    }
    __pipeline_commit();
    if (remaining > 1)
    {
        issueRows(in + stepElems, 1);
    }
    __pipeline_commit();
    while (remaining > 0) // the same count on every thread of the block (one token row per block)
    {
        token(std::integral_constant<int, 0>{});
        if (remaining == 0)
        {
            break;
        }
        token(std::integral_constant<int, 1>{});
        if (remaining == 0)
        {
            break;
        }
        token(std::integral_constant<int, 2>{});
    }

    if constexpr (!T::kIsFloat32)
    {
        if (__builtin_expect(packedNaN != 0, 0))
        {
            for (int64_t tt = blockIdx.x / 2; tt < a.numTokens; tt += a.tokenStep)
            {
                Storage* const row = dst + tt * tokenElems;
#pragma unroll
                for (int u = 0; u < ROWS; ++u)
                {
#pragma unroll
                    for (int v = 0; v < kNV; ++v)
                    {
                        if ((stored >> u) & 1U)
                        {
                            uint4* const chunk = reinterpret_cast<uint4*>(row + rowOffset[u] + v * kLanes * kVec);
                            *chunk = Ch::canonicalNaNs(*chunk);
                        }
                    }
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// General path: one warp per (token, q/k, head) row, lane owning element pairs lane + 32 i. The
// pieces of a row (load, sum of squares, normalise-rotate-store) are shared with the norm_scope 1
// kernel below, which runs them per head of a token row.
template <typename T, int PAIRS, bool ALIGNED>
struct GeneralRow
{
    using Storage = typename T::Storage;
    static constexpr int kE = 2 * PAIRS;

    __device__ __forceinline__ static int elemOf(int lane, int i, int c)
    {
        return 2 * (lane + kGeneralLanes * i) + c;
    }

    // The weights of one row: element e of the tensor at `weight`, from element `at` on.
    __device__ __forceinline__ static void loadWeights(
        void const* weight, int64_t at, bool weightsFp32, int lane, int headDim, float (&w)[kE])
    {
#pragma unroll
        for (int i = 0; i < kE; ++i)
        {
            int const e = elemOf(lane, i / 2, i % 2);
            w[i] = e < headDim ? loadWeight<T>(weight, at + e, weightsFp32) : 0.0F;
        }
    }

    __device__ __forceinline__ static void load(Storage const* row, int lane, int headDim, float (&x)[kE])
    {
#pragma unroll
        for (int i = 0; i < PAIRS; ++i)
        {
            int const e = elemOf(lane, i, 0);
            if (e < headDim)
            {
                if constexpr (ALIGNED)
                {
                    using Pair = std::conditional_t<sizeof(Storage) == 4, uint2, uint32_t>;
                    Pair const bits = *reinterpret_cast<Pair const*>(row + e);
                    Storage pair[2];
                    memcpy(pair, &bits, sizeof(pair));
                    x[2 * i] = T::toFloat(pair[0]);
                    x[2 * i + 1] = T::toFloat(pair[1]);
                }
                else
                {
                    x[2 * i] = T::toFloat(row[e]);
                    x[2 * i + 1] = T::toFloat(row[e + 1]);
                }
            }
            else
            {
                x[2 * i] = 0.0F;
                x[2 * i + 1] = 0.0F;
            }
        }
    }

    // The row's sum of squares on every lane (math::sumSquares with 32 lanes of pairs).
    __device__ __forceinline__ static float sumSquares(float const (&x)[kE])
    {
        float sumSq = 0.0F;
#pragma unroll
        for (int i = 0; i < kE; ++i)
        {
            sumSq = math::fmaSquare(x[i], sumSq); // zeros past head_dim add exactly nothing
        }
#pragma unroll
        for (int offset = kGeneralLanes / 2; offset > 0; offset /= 2)
        {
            sumSq = math::add(sumSq, __shfl_xor_sync(kFullMask, sumSq, offset, kGeneralLanes));
        }
        return sumSq;
    }

    // Normalise with inv and w, rotate with cacheRow, store to outRow. ys: the warp's staging row
    // for the NeoX partner exchange.
    __device__ __forceinline__ static void finish(float const (&x)[kE], float inv, float const (&w)[kE],
        float const* cacheRow, Storage* outRow, int lane, int headDim, int rot, bool interleaved, int32_t rounding,
        float* ys)
    {
        int const half = rot / 2;
        float y[kE];
#pragma unroll
        for (int i = 0; i < kE; ++i)
        {
            y[i] = math::normalize<T>(x[i], inv, w[i], rounding);
        }

        float o[kE];
        if (interleaved)
        {
#pragma unroll
            for (int i = 0; i < PAIRS; ++i)
            {
                int const j = elemOf(lane, i, 0) / 2;
                if (2 * j < rot)
                {
                    float const c = __ldg(cacheRow + j);
                    float const n = __ldg(cacheRow + half + j);
                    o[2 * i] = math::rotateFirst(y[2 * i], y[2 * i + 1], c, n);
                    o[2 * i + 1] = math::rotateSecond(y[2 * i], y[2 * i + 1], c, n);
                }
                else
                {
                    o[2 * i] = y[2 * i];
                    o[2 * i + 1] = y[2 * i + 1];
                }
            }
        }
        else
        {
#pragma unroll
            for (int i = 0; i < kE; ++i)
            {
                int const e = elemOf(lane, i / 2, i % 2);
                if (e < headDim)
                {
                    ys[e] = y[i];
                }
            }
            __syncwarp();
#pragma unroll
            for (int i = 0; i < kE; ++i)
            {
                int const e = elemOf(lane, i / 2, i % 2);
                o[i] = y[i];
                if (e < half)
                {
                    o[i] = math::rotateFirst(y[i], ys[e + half], __ldg(cacheRow + e), __ldg(cacheRow + half + e));
                }
                else if (e < rot)
                {
                    int const j = e - half;
                    o[i] = math::rotateSecond(ys[j], y[i], __ldg(cacheRow + j), __ldg(cacheRow + half + j));
                }
            }
            __syncwarp(); // ys is rewritten for the next row
        }

#pragma unroll
        for (int i = 0; i < PAIRS; ++i)
        {
            int const e = elemOf(lane, i, 0);
            if (e < headDim)
            {
                Storage const pair[2] = {T::fromFloat(o[2 * i]), T::fromFloat(o[2 * i + 1])};
                if constexpr (ALIGNED)
                {
                    using Pair = std::conditional_t<sizeof(Storage) == 4, uint2, uint32_t>;
                    Pair bits;
                    memcpy(&bits, pair, sizeof(bits));
                    *reinterpret_cast<Pair*>(outRow + e) = bits;
                }
                else
                {
                    outRow[e] = pair[0];
                    outRow[e + 1] = pair[1];
                }
            }
        }
    }
};

// kernel-report: qkNormRopeGeneralKernel<T, PAIRS, ALIGNED>
template <typename T, int PAIRS, bool ALIGNED>
__global__ void __launch_bounds__(kThreads) qkNormRopeGeneralKernel(KernelArgs const a)
{
    using Row = GeneralRow<T, PAIRS, ALIGNED>;
    using Storage = typename T::Storage;
    constexpr int kE = Row::kE;
    static_assert(PAIRS * 2 * kGeneralLanes >= 2 && PAIRS <= kMAX_HEAD_DIM / (2 * kGeneralLanes), "pairs");
    __shared__ float staged[kWarpsPerBlock][kMAX_HEAD_DIM]; // NeoX partner exchange

    int const warp = static_cast<int>(threadIdx.x) / 32;
    int const lane = static_cast<int>(threadIdx.x) % 32;
    int64_t const group = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp;
    int const units = a.unitsPerToken; // 2 * numHeads
    int const slot = static_cast<int>(group % units);
    int64_t t = group / units;
    int const numHeads = a.numHeads;
    bool const isQ = slot < numHeads;
    int const head = isQ ? slot : slot - numHeads;
    int const headDim = a.headDim;
    int const rot = a.rotaryDim;
    int64_t const tokenElems = static_cast<int64_t>(numHeads) * headDim;
    Storage const* const src = static_cast<Storage const*>(isQ ? a.q : a.k) + static_cast<int64_t>(head) * headDim;
    Storage* const dst = static_cast<Storage*>(isQ ? a.qOut : a.kOut) + static_cast<int64_t>(head) * headDim;
    float* const ys = staged[warp];

    float w[kE];
    Row::loadWeights(isQ ? a.qWeight : a.kWeight, 0, a.weightsFp32, lane, headDim, w);

    int64_t s = t < a.numTokens ? t % a.seqLen : 0;
    for (; t < a.numTokens; t += a.tokenStep)
    {
        float x[kE];
        Row::load(src + t * tokenElems, lane, headDim, x);
        float const inv = math::rmsInv(Row::sumSquares(x), headDim, a.eps);
        Row::finish(x, inv, w, a.cache + s * rot, dst + t * tokenElems, lane, headDim, rot, a.interleaved, a.rounding,
            ys);
        s += a.seqStep;
        s = s >= a.seqLen ? s - a.seqLen : s;
    }
}

// General path, norm_scope 1: one warp per (token, q/k) row of num_heads x head_dim values. A first
// pass over the heads adds each head's sum of squares (the per-head order above) into lane h % 32,
// a butterfly gives the row's sum (math::rowSumSquares); a second pass reads each head again (an
// L1/L2 hit), normalises with its slice of the [heads x head_dim] weight and rotates it.
// kernel-report: qkNormRopeGeneralRowKernel<T, PAIRS, ALIGNED>
template <typename T, int PAIRS, bool ALIGNED>
__global__ void __launch_bounds__(kThreads) qkNormRopeGeneralRowKernel(KernelArgs const a)
{
    using Row = GeneralRow<T, PAIRS, ALIGNED>;
    using Storage = typename T::Storage;
    constexpr int kE = Row::kE;
    static_assert(PAIRS * 2 * kGeneralLanes >= 2 && PAIRS <= kMAX_HEAD_DIM / (2 * kGeneralLanes), "pairs");
    __shared__ float staged[kWarpsPerBlock][kMAX_HEAD_DIM]; // NeoX partner exchange

    int const warp = static_cast<int>(threadIdx.x) / 32;
    int const lane = static_cast<int>(threadIdx.x) % 32;
    int64_t const group = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + warp;
    int const units = a.unitsPerToken; // 2: q, k
    bool const isQ = group % units == 0;
    int64_t t = group / units;
    int const numHeads = a.numHeads;
    int const headDim = a.headDim;
    int const rot = a.rotaryDim;
    int64_t const tokenElems = static_cast<int64_t>(numHeads) * headDim;
    Storage const* const src = static_cast<Storage const*>(isQ ? a.q : a.k);
    Storage* const dst = static_cast<Storage*>(isQ ? a.qOut : a.kOut);
    void const* const weight = isQ ? a.qWeight : a.kWeight;
    float* const ys = staged[warp];

    int64_t s = t < a.numTokens ? t % a.seqLen : 0;
    for (; t < a.numTokens; t += a.tokenStep)
    {
        Storage const* const row = src + t * tokenElems;
        float partial = 0.0F;
#pragma unroll 1 // a rolled loop: unrolled, ptxas spilled two instances (sm_90)
        for (int h = 0; h < numHeads; ++h)
        {
            float x[kE];
            Row::load(row + static_cast<int64_t>(h) * headDim, lane, headDim, x);
            float const headSum = Row::sumSquares(x);
            partial = lane == h % kGeneralLanes ? math::add(partial, headSum) : partial;
        }
#pragma unroll
        for (int offset = kGeneralLanes / 2; offset > 0; offset /= 2)
        {
            partial = math::add(partial, __shfl_xor_sync(kFullMask, partial, offset, kGeneralLanes));
        }
        float const inv = math::rmsInv(partial, a.rowElems, a.eps);
#pragma unroll 1
        for (int h = 0; h < numHeads; ++h)
        {
            int64_t const at = static_cast<int64_t>(h) * headDim;
            float x[kE];
            Row::load(row + at, lane, headDim, x);
            float w[kE];
            Row::loadWeights(weight, at, a.weightsFp32, lane, headDim, w);
            Row::finish(x, inv, w, a.cache + s * rot, dst + t * tokenElems + at, lane, headDim, rot, a.interleaved,
                a.rounding, ys);
        }
        s += a.seqStep;
        s = s >= a.seqLen ? s - a.seqLen : s;
    }
}

// ---------------------------------------------------------------------------------------------
// Launch helpers.

// The one place kernels are launched. cudaLaunchKernel returns the status of this launch itself,
// so an error left behind by earlier work on the thread is never reported as this launch's
// failure (cudaGetLastError after <<<>>> would). Each argument is converted to the kernel's
// parameter type first, so the runtime reads exactly the objects it expects.
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

// A device query that fails falls back to `fallback`; the error it raised is consumed only when
// the thread had none before, so an earlier error stays for its owner to read.
template <typename Query>
int queryOr(Query query, int fallback)
{
    cudaError_t const before = cudaPeekAtLastError();
    int value = 0;
    if (query(&value) != cudaSuccess || value <= 0)
    {
        if (before == cudaSuccess)
        {
            (void) cudaGetLastError();
        }
        return fallback;
    }
    return value;
}

int smCount(int device)
{
    static std::atomic<int> cached[kMaxDevices];
    bool const cacheable = device >= 0 && device < kMaxDevices;
    if (cacheable && cached[device].load(std::memory_order_relaxed) > 0)
    {
        return cached[device].load(std::memory_order_relaxed);
    }
    int const count = queryOr(
        [device](int* v) { return cudaDeviceGetAttribute(v, cudaDevAttrMultiProcessorCount, device); }, 1);
    if (cacheable)
    {
        cached[device].store(count, std::memory_order_relaxed);
    }
    return count;
}

// The plan's model of a device (qknorm_rope_plan.h deviceModel), from its attributes; cached per
// device. A query that fails leaves a neutral figure (the plan then compares instances on equal
// terms).
DeviceModel deviceModelOf(int device)
{
    auto query = [device]() {
        auto attr = [device](cudaDeviceAttr which, int fallback) {
            return queryOr([device, which](int* v) { return cudaDeviceGetAttribute(v, which, device); }, fallback);
        };
        return deviceModel(smCount(device), attr(cudaDevAttrComputeCapabilityMajor, 9),
            attr(cudaDevAttrComputeCapabilityMinor, 0), attr(cudaDevAttrClockRate, 1000000),
            attr(cudaDevAttrMemoryClockRate, 1000000), attr(cudaDevAttrGlobalMemoryBusWidth, 4096));
    };
    if (device < 0 || device >= kMaxDevices)
    {
        return query();
    }
    static std::once_flag once[kMaxDevices];
    static DeviceModel models[kMaxDevices];
    std::call_once(once[device], [&] { models[device] = query(); });
    return models[device];
}

// Resident blocks of KERNEL on the whole device (blocks per SM from the occupancy query x SMs),
// cached per kernel instance and device.
template <auto KERNEL>
int64_t residentBlocks(int device)
{
    auto const kernel = KERNEL;
    static std::atomic<int> cached[kMaxDevices];
    bool const cacheable = device >= 0 && device < kMaxDevices;
    int perSm = cacheable ? cached[device].load(std::memory_order_relaxed) : 0;
    if (perSm <= 0)
    {
        perSm = queryOr(
            [kernel](int* v) { return cudaOccupancyMaxActiveBlocksPerMultiprocessor(v, kernel, kThreads, 0); }, 1);
        if (cacheable)
        {
            cached[device].store(perSm, std::memory_order_relaxed);
        }
    }
    return static_cast<int64_t>(perSm) * smCount(device);
}

template <typename T, int HEAD_DIM, bool INTERLEAVED>
constexpr int maxRows()
{
    return fastMaxRows(HEAD_DIM, static_cast<int>(sizeof(typename T::Storage)), INTERLEAVED);
}

template <typename T, int HEAD_DIM, bool INTERLEAVED, int ROUNDING, bool FULL_ROTARY, int ROWS>
int64_t fastResidentPerSm(int device)
{
    if constexpr (ROWS <= maxRows<T, HEAD_DIM, INTERLEAVED>())
    {
        return residentBlocks<qkNormRopeFastKernel<T, HEAD_DIM, INTERLEAVED, ROWS, ROUNDING, FULL_ROTARY>>(device)
            / smCount(device);
    }
    return 0;
}

template <typename T, int HEAD_DIM, bool INTERLEAVED, int ROUNDING, bool FULL_ROTARY, int ROWS>
cudaError_t launchFastRows(KernelArgs const& a, dim3 const grid, cudaStream_t stream)
{
    if constexpr (ROWS <= maxRows<T, HEAD_DIM, INTERLEAVED>())
    {
        return launchKernel(qkNormRopeFastKernel<T, HEAD_DIM, INTERLEAVED, ROWS, ROUNDING, FULL_ROTARY>, grid,
            dim3(kThreads), stream, a);
    }
    return cudaErrorInvalidValue; // unreachable: launchFast never picks more than maxRows()
}

// Fast path: the rows per unit the launch plan picks (planFast in qknorm_rope_plan.h: the least
// estimated time on this device's model, ties to more rows).
template <typename T, int HEAD_DIM, bool INTERLEAVED, int ROUNDING, bool FULL_ROTARY>
cudaError_t launchFast(KernelArgs a, int device, cudaStream_t stream)
{
    constexpr int kBytes = static_cast<int>(sizeof(typename T::Storage));
    static_assert(maxRows<T, HEAD_DIM, INTERLEAVED>() <= kMaxRows, "rows per unit");
    int64_t const resident[kMaxRows] = {fastResidentPerSm<T, HEAD_DIM, INTERLEAVED, ROUNDING, FULL_ROTARY, 1>(device),
        fastResidentPerSm<T, HEAD_DIM, INTERLEAVED, ROUNDING, FULL_ROTARY, 2>(device),
        fastResidentPerSm<T, HEAD_DIM, INTERLEAVED, ROUNDING, FULL_ROTARY, 3>(device)};
    FastProblem const problem{a.numTokens, a.numHeads, HEAD_DIM, a.rotaryDim, kBytes, ROUNDING, INTERLEAVED};
    FastEstimate const plan
        = planFast(problem, maxRows<T, HEAD_DIM, INTERLEAVED>(), resident, deviceModelOf(device));
    a.unitsPerToken = static_cast<int32_t>(plan.unitsPerToken);
    a.tokenStep = plan.split.tokenStep;
    a.seqStep = plan.split.tokenStep % a.seqLen;
    a.stepElems = a.tokenStep * a.numHeads * HEAD_DIM;
    a.trigStep = a.seqStep * a.rotaryDim;
    a.trigWrap = a.seqLen * a.rotaryDim;
    dim3 const grid(static_cast<unsigned>(plan.split.blocks));
    switch (plan.rows)
    {
    case 1: return launchFastRows<T, HEAD_DIM, INTERLEAVED, ROUNDING, FULL_ROTARY, 1>(a, grid, stream);
    case 2: return launchFastRows<T, HEAD_DIM, INTERLEAVED, ROUNDING, FULL_ROTARY, 2>(a, grid, stream);
    default: return launchFastRows<T, HEAD_DIM, INTERLEAVED, ROUNDING, FULL_ROTARY, 3>(a, grid, stream);
    }
}

// Resident blocks per SM of KERNEL at a block size (the row kernel's varies with the head count),
// cached per kernel instance, device and warps per block.
template <auto KERNEL>
int64_t residentPerSmAt(int device, int threads)
{
    auto const kernel = KERNEL;
    constexpr int kMaxWarps = kPlanRowMaxThreads / 32;
    static std::atomic<int> cached[kMaxDevices][kMaxWarps + 1];
    int const warps = threads / 32;
    bool const cacheable = device >= 0 && device < kMaxDevices && warps >= 1 && warps <= kMaxWarps;
    int perSm = cacheable ? cached[device][warps].load(std::memory_order_relaxed) : 0;
    if (perSm <= 0)
    {
        perSm = queryOr(
            [kernel, threads](int* v) { return cudaOccupancyMaxActiveBlocksPerMultiprocessor(v, kernel, threads, 0); },
            1);
        if (cacheable)
        {
            cached[device][warps].store(perSm, std::memory_order_relaxed);
        }
    }
    return perSm;
}

template <typename T, int HEAD_DIM, bool INTERLEAVED, int ROUNDING, bool FULL_ROTARY, int ROWS>
int64_t rowResidentPerSm(int64_t numHeads, int device)
{
    constexpr int kBytes = static_cast<int>(sizeof(typename T::Storage));
    if constexpr (ROWS >= 1)
    {
        if (rowFits(numHeads, ROWS, HEAD_DIM, kBytes))
        {
            int const threads = static_cast<int>(rowThreads(numHeads, ROWS, fastLanes(HEAD_DIM, kBytes)));
            return residentPerSmAt<qkNormRopeRowKernel<T, HEAD_DIM, INTERLEAVED, ROWS, ROUNDING, FULL_ROTARY>>(
                device, threads);
        }
    }
    return 0;
}

template <typename T, int HEAD_DIM, bool INTERLEAVED, int ROUNDING, bool FULL_ROTARY, int ROWS>
cudaError_t launchRowRows(KernelArgs const& a, dim3 const grid, dim3 const block, cudaStream_t stream)
{
    if constexpr (ROWS >= 1)
    {
        return launchKernel(
            qkNormRopeRowKernel<T, HEAD_DIM, INTERLEAVED, ROWS, ROUNDING, FULL_ROTARY>, grid, block, stream, a);
    }
    return cudaErrorInvalidValue; // unreachable: planRow never picks zero rows
}

// norm_scope 1, fast path: the rows per group (so the block size) the launch plan picks (planRow).
template <typename T, int HEAD_DIM, bool INTERLEAVED, int ROUNDING, bool FULL_ROTARY>
cudaError_t launchRow(KernelArgs a, int device, cudaStream_t stream)
{
    constexpr int kBytes = static_cast<int>(sizeof(typename T::Storage));
    constexpr int kMax = rowMaxRows(HEAD_DIM, kBytes, INTERLEAVED, FULL_ROTARY, ROUNDING);
    int64_t const resident[2] = {rowResidentPerSm<T, HEAD_DIM, INTERLEAVED, ROUNDING, FULL_ROTARY, kMax>(a.numHeads, device),
        rowResidentPerSm<T, HEAD_DIM, INTERLEAVED, ROUNDING, FULL_ROTARY, kMax / 2>(a.numHeads, device)};
    FastProblem const problem{a.numTokens, a.numHeads, HEAD_DIM, a.rotaryDim, kBytes, ROUNDING, INTERLEAVED};
    RowEstimate const plan = planRow(problem, kMax, resident, deviceModelOf(device));
    if (plan.rows == 0)
    {
        return cudaErrorInvalidValue; // unreachable: selectPath sends a row that fits no block to the general path
    }
    a.unitsPerToken = 2;
    a.tokenStep = plan.split.tokenStep;
    a.seqStep = plan.split.tokenStep % a.seqLen;
    a.stepElems = a.tokenStep * a.numHeads * HEAD_DIM;
    a.trigStep = a.seqStep * a.rotaryDim;
    a.trigWrap = a.seqLen * a.rotaryDim;
    dim3 const grid(static_cast<unsigned>(plan.split.blocks));
    dim3 const block(static_cast<unsigned>(plan.threads));
    return plan.rows == kMax ? launchRowRows<T, HEAD_DIM, INTERLEAVED, ROUNDING, FULL_ROTARY, kMax>(a, grid, block, stream)
                             : launchRowRows<T, HEAD_DIM, INTERLEAVED, ROUNDING, FULL_ROTARY, kMax / 2>(a, grid, block, stream);
}

template <typename T, int HEAD_DIM, bool INTERLEAVED, int ROUNDING, bool FULL_ROTARY, bool ROW>
cudaError_t launchScope(KernelArgs const& a, int device, cudaStream_t stream)
{
    if constexpr (ROW)
    {
        return launchRow<T, HEAD_DIM, INTERLEAVED, ROUNDING, FULL_ROTARY>(a, device, stream);
    }
    return launchFast<T, HEAD_DIM, INTERLEAVED, ROUNDING, FULL_ROTARY>(a, device, stream);
}

template <typename T, int HEAD_DIM, bool INTERLEAVED, int ROUNDING, bool ROW>
cudaError_t launchFastRotary(KernelArgs const& a, int device, cudaStream_t stream)
{
    constexpr int kNV = fastChunksPerThread(HEAD_DIM, static_cast<int>(sizeof(typename T::Storage)));
    if (a.rotaryDim == HEAD_DIM)
    {
        return launchScope<T, HEAD_DIM, INTERLEAVED, ROUNDING, true, ROW>(a, device, stream);
    }
    if constexpr (INTERLEAVED || kNV == 1)
    {
        return launchScope<T, HEAD_DIM, INTERLEAVED, ROUNDING, false, ROW>(a, device, stream);
    }
    return cudaErrorInvalidValue; // unreachable: selectPath sends this case to the general path
}

template <typename T, int HEAD_DIM, bool ROW>
cudaError_t launchFastHeadDim(KernelArgs const& a, bool interleaved, int rounding, int device, cudaStream_t stream)
{
    if constexpr (!T::kIsFloat32)
    {
        if (rounding == math::kRoundingDiffusers)
        {
            return interleaved ? launchFastRotary<T, HEAD_DIM, true, math::kRoundingDiffusers, ROW>(a, device, stream)
                               : launchFastRotary<T, HEAD_DIM, false, math::kRoundingDiffusers, ROW>(a, device, stream);
        }
        if (rounding == math::kRoundingFlux)
        {
            return interleaved ? launchFastRotary<T, HEAD_DIM, true, math::kRoundingFlux, ROW>(a, device, stream)
                               : launchFastRotary<T, HEAD_DIM, false, math::kRoundingFlux, ROW>(a, device, stream);
        }
    }
    // rounding 0; and fp32 in every mode, where the three are one computation (nothing narrower)
    return interleaved ? launchFastRotary<T, HEAD_DIM, true, 0, ROW>(a, device, stream)
                       : launchFastRotary<T, HEAD_DIM, false, 0, ROW>(a, device, stream);
}

template <typename T, int HEAD_DIM>
cudaError_t launchFastScoped(KernelArgs const& a, QKNormRoPEParams const& p, int device, cudaStream_t stream)
{
    return p.normScope == kNORM_SCOPE_ROW
        ? launchFastHeadDim<T, HEAD_DIM, true>(a, p.interleaved, p.rounding, device, stream)
        : launchFastHeadDim<T, HEAD_DIM, false>(a, p.interleaved, p.rounding, device, stream);
}

template <typename T, int PAIRS, bool ALIGNED, bool ROW>
cudaError_t launchGeneralKernel(KernelArgs a, int device, cudaStream_t stream)
{
    constexpr auto kernel = ROW ? qkNormRopeGeneralRowKernel<T, PAIRS, ALIGNED> : qkNormRopeGeneralKernel<T, PAIRS, ALIGNED>;
    int64_t const units = ROW ? 2 : 2 * static_cast<int64_t>(a.numHeads); // warps per token
    TokenSplit const split = splitTokens(a.numTokens, units, kWarpsPerBlock, residentBlocks<kernel>(device));
    a.unitsPerToken = static_cast<int32_t>(units);
    a.tokenStep = split.tokenStep;
    a.seqStep = split.tokenStep % a.seqLen;
    return launchKernel(kernel, dim3(static_cast<unsigned>(split.blocks)), dim3(kThreads), stream, a);
}

template <typename T, int PAIRS, bool ROW>
cudaError_t launchGeneralPairs(KernelArgs const& a, bool isAligned, int device, cudaStream_t stream)
{
    return isAligned ? launchGeneralKernel<T, PAIRS, true, ROW>(a, device, stream)
                     : launchGeneralKernel<T, PAIRS, false, ROW>(a, device, stream);
}

template <typename T, bool ROW>
cudaError_t launchGeneral(KernelArgs const& a, int device, cudaStream_t stream)
{
    constexpr uintptr_t kPairBytes = 2 * sizeof(typename T::Storage);
    bool const isAligned = aligned(a.q, kPairBytes) && aligned(a.k, kPairBytes) && aligned(a.qOut, kPairBytes)
        && aligned(a.kOut, kPairBytes);
    int const pairsPerLane = static_cast<int>(ceilDiv(a.headDim, 2 * kGeneralLanes));
    if (pairsPerLane <= 1)
        return launchGeneralPairs<T, 1, ROW>(a, isAligned, device, stream);
    if (pairsPerLane <= 2)
        return launchGeneralPairs<T, 2, ROW>(a, isAligned, device, stream);
    if (pairsPerLane <= 4)
        return launchGeneralPairs<T, 4, ROW>(a, isAligned, device, stream);
    return launchGeneralPairs<T, 8, ROW>(a, isAligned, device, stream);
}

template <typename T>
cudaError_t dispatch(KernelArgs const& a, QKNormRoPEParams const& p, int device, cudaStream_t stream)
{
    if (selectPath(p) == KernelPath::kFast)
    {
        switch (a.headDim)
        {
        case 64: return launchFastScoped<T, 64>(a, p, device, stream);
        case 128: return launchFastScoped<T, 128>(a, p, device, stream);
        default: return launchFastScoped<T, 256>(a, p, device, stream);
        }
    }
    return p.normScope == kNORM_SCOPE_ROW ? launchGeneral<T, true>(a, device, stream)
                                          : launchGeneral<T, false>(a, device, stream);
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
    a.eps = p.eps;
    a.rounding = p.rounding;
    a.interleaved = p.interleaved;
    a.weightsFp32 = p.weightsFp32 && p.dtype != DataType::kFLOAT32; // fp32 activations: one layout
    a.rowElems = static_cast<int32_t>(p.numHeads * p.headDim); // < 2^31 (checkParams)

    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess)
    {
        return Status::kCUDA_ERROR;
    }
    cudaError_t err = cudaSuccess;
    switch (p.dtype)
    {
    case DataType::kFLOAT32: err = dispatch<Fp32>(a, p, device, stream); break;
    case DataType::kFLOAT16: err = dispatch<Fp16>(a, p, device, stream); break;
    case DataType::kBFLOAT16: err = dispatch<Bf16>(a, p, device, stream); break;
    }
    return err == cudaSuccess ? Status::kSUCCESS : Status::kCUDA_ERROR;
}

} // namespace qkrope
