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

// norm_scope 1, fast path (qkNormRopeRowKernel): a block owns a token's q or k row; groups of
// fastLanes threads own ROWS consecutive heads each. The block size is rowThreads (a whole number of
// warps), at most rowMaxThreads: the ring (kPlanPrefetch + 1 stages x ROWS x chunks x 16 B per
// thread) and the head sums stay within 48 KiB of static shared memory per block.
constexpr int kPlanRowMaxThreads = 256; // __launch_bounds__ of the row kernel (<= 128 registers at 2 blocks)

QKROPE_PLAN_HD constexpr int rowMaxThreads(int rowsTimesChunks)
{
    return rowsTimesChunks >= 4 ? 224 : kPlanRowMaxThreads;
}

// Rows (heads) per group of the row kernel's largest instance. Each row's weights stay in registers
// (rows x elements per thread floats), so 4 rows fit 128 registers only where the rest of the token
// is light: one chunk per thread, interleaved pairs at full rotary width, and not diffusers' order
// (its two round trips per pair), and with bf16 not at head_dim 64 (ptxas -v, nvcc 13.0, sm_90:
// these instances use 106-127 registers without spilling; NeoX, partial rotary or rounding 1 at 4
// rows spill; so does bf16 at head_dim 64 in FLUX's order, which excludes 16-bit types there).
// Everything else has 2. The launcher's candidates are this and half of it. rounding: the instance's
// (0 for fp32, whatever the node says).
QKROPE_PLAN_HD constexpr int rowMaxRows(int headDim, int elemBytes, bool interleaved, bool fullRotary, int rounding)
{
    return fastChunksPerThread(headDim, elemBytes) == 1 && interleaved && fullRotary && rounding != 1
            && !(elemBytes == 2 && headDim == 64 && rounding == 2)
        ? 4
        : 2;
}

QKROPE_PLAN_HD constexpr int64_t rowThreads(int64_t numHeads, int rows, int lanes)
{
    return ((numHeads + rows - 1) / rows * lanes + 31) / 32 * 32;
}

// Whether rows per group fit one block for this head count.
QKROPE_PLAN_HD constexpr bool rowFits(int64_t numHeads, int rows, int headDim, int elemBytes)
{
    return rowThreads(numHeads, rows, fastLanes(headDim, elemBytes))
        <= rowMaxThreads(rows * fastChunksPerThread(headDim, elemBytes));
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
    if (p.normScope == kNORM_SCOPE_ROW)
    {
        int const bytes = elementBytes(p.dtype);
        int const head = static_cast<int>(p.headDim);
        int const rounding = p.dtype == DataType::kFLOAT32 ? 0 : p.rounding; // the instance's
        if (!rowFits(p.numHeads, rowMaxRows(head, bytes, p.interleaved, p.rotaryDim == p.headDim, rounding), head,
                bytes))
        {
            return KernelPath::kGeneral; // the token's heads do not fit one block of the row kernel
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

// ---------------------------------------------------------------------------------------------
// The launch plan of the fast path: how many rows (heads of one token) a row group owns per unit.
//
// For every candidate instance (rows = 1..maxRows, each with the resident blocks per SM that the
// occupancy query gives for its register count) the plan estimates the launch's time on a model
// of the device and the launcher takes the minimum (ties to more rows). The estimate is
//
//   time = latency + prologue issue + rounds x max(issue per round, memory per round)
//          + issue per round (the last token's arithmetic: nothing is left to overlap it with)
//
//   - rounds: tokens per row group of the busiest group, ceil(tokens / tokenStep), where
//     splitTokens sizes the grid in whole tokens (the wave quantisation: a launch whose tokens do
//     not fill the last round still pays a whole round on its busiest SM);
//   - issue per round: the busiest SM's warps x instructions per token of one unit, over
//     schedulers x clock (perfect issue, one warp-instruction per scheduler per cycle);
//   - memory per round: the larger of the bytes the SM moves in a round at its share of the peak
//     DRAM bandwidth, and all the bytes of a round (reads and writes, issue 31's accounting) at
//     the bandwidth Little's law leaves with kPrefetch rounds of q/k reads in flight, asking for
//     kLatencyMargin times the floor because the latency is an assumption
//     (kLatencyMargin x latency x round bytes / (min(kPrefetch, rounds) x round reads)).
//     kPrefetch rounds is what the compiled schedule keeps: the rows travel through a shared-memory
//     ring of cp.async groups and each token's wait (cp.async.wait_group kPrefetch) retires only its
//     own group, so the next kPrefetch tokens' rows stay outstanding past every wait (the SASS
//     scoreboards, read by scripts/kernel_report.py, show it: bytesInFlightPerSm below);
//   - latency: the first loads of a launch wait one full DRAM latency before anything overlaps.
// Instructions per unit-token and per group (prologue + epilogue) are the common-path SASS counts
// of the instances (scripts/kernel_report.py measures them on sm_90; tests/test_kernel_report.py
// checks these constants against that measurement for the instances the launcher picks).
// ---------------------------------------------------------------------------------------------

constexpr int kPlanThreads = 256;  // threads per block of every kernel (qknorm_rope.cu kThreads)
constexpr int kPlanPrefetch = 2;   // fast path: tokens of rows in flight (cp.async groups) past each wait
constexpr int kPlanMaxRows = 3;    // rows per unit of any fast-path instance
constexpr double kLatencyMargin = 2.0; // bytes in flight asked for: twice Little's law (DESIGN.md targets)

// Rows per unit of an instance: 3 for interleaved pairs in one chunk, 2 where NeoX shuffles or two
// chunks per thread need more registers (128 per thread at two blocks per SM). The ring of
// kPlanPrefetch + 1 stages in static shared memory stays within 48 KiB per block: at most
// 3 stages x 3 rows x 16 B x 256 threads = 36 KiB, or 3 x 2 rows x 2 chunks x 16 B x 256 = 48 KiB
// (fp32, head_dim 256). tests/test_kernel_report.py asserts no instance spills.
QKROPE_PLAN_HD constexpr int fastMaxRows(int headDim, int elemBytes, bool interleaved)
{
    return interleaved && fastChunksPerThread(headDim, elemBytes) == 1 ? 3 : 2;
}

struct DeviceModel
{
    int sms = 1;
    int smVersion = 0;         // 10 x major + minor
    double clockGHz = 1.0;     // SM clock (cudaDevAttrClockRate)
    double dramBytesPerNs = 1; // peak DRAM bandwidth: 2 (DDR) x memory clock x bus width / 8
    double latencyNs = 1000;   // loaded DRAM latency (dramLatencyNs: an assumption, not a query)
    int schedulersPerSm = 4;   // warp-instructions issued per SM per cycle (sm_70 and later)
};

// Loaded DRAM latency assumed per architecture (ns): no device query reports it. Hopper/Blackwell
// HBM under a streaming load sits at ~0.8-1 us; Ampere/Ada at ~0.6-0.8 us. The larger figure is
// taken, so the plan errs towards more bytes in flight.
inline double dramLatencyNs(int smVersion)
{
    return smVersion >= 90 ? 1000.0 : 800.0;
}

// The model from the attributes the launcher queries (clock and memory clock in kHz).
inline DeviceModel deviceModel(int sms, int ccMajor, int ccMinor, int clockKHz, int memClockKHz, int busWidthBits)
{
    DeviceModel d;
    d.sms = sms > 0 ? sms : 1;
    d.smVersion = ccMajor * 10 + ccMinor;
    d.clockGHz = clockKHz > 0 ? clockKHz * 1e-6 : 1.0;
    double const bw = 2.0 * memClockKHz * 1e3 * (busWidthBits / 8.0) * 1e-9; // bytes per ns
    d.dramBytesPerNs = bw > 0 ? bw : 1.0;
    d.latencyNs = dramLatencyNs(d.smVersion);
    return d;
}

inline int64_t ceilDiv(int64_t a, int64_t b)
{
    return (a + b - 1) / b;
}

inline int64_t gcd64(int64_t a, int64_t b)
{
    while (b != 0)
    {
        int64_t const r = a % b;
        a = b;
        b = r;
    }
    return a;
}

struct TokenSplit
{
    int64_t blocks;    // grid size
    int64_t tokenStep; // tokens in flight at once = tokens between a group's consecutive tokens
};

// Grid for `unitsPerToken` row-group slots per token and `groupsPerBlock` groups per block: a
// multiple of the smallest block count whose groups cover whole tokens, no larger than the
// resident blocks (so every block is resident and walks tokens) nor than the problem needs.
inline TokenSplit splitTokens(int64_t numTokens, int64_t unitsPerToken, int64_t groupsPerBlock, int64_t resident)
{
    int64_t const g = gcd64(unitsPerToken, groupsPerBlock);
    int64_t const quantumBlocks = unitsPerToken / g;
    int64_t const quantumTokens = groupsPerBlock / g;
    int64_t const needed = ceilDiv(numTokens, quantumTokens) * quantumBlocks;
    int64_t const fit = resident / quantumBlocks * quantumBlocks;
    int64_t blocks = needed < fit ? needed : fit;
    blocks = blocks > quantumBlocks ? blocks : quantumBlocks;
    return TokenSplit{blocks, blocks / quantumBlocks * quantumTokens};
}

// Common-path instructions of one thread (sm_90 SASS of the bf16, head_dim 128, interleaved
// instances; kernel_report.py measures them): per element of a row, per token of a unit (cos/sin
// loads, pointer steps, loop control), and per group outside the loop (prologue + epilogue).
struct FastIssueCost
{
    double perElement;
    double perToken;
    double perGroup;
};

// By rounding mode (math::kRounding*): 0 one rounding; 1 diffusers' order, two pair round trips
// to the element type before the rotation; 2 FLUX's order, one (a pack and two unpacks per pair).
// Fitted over rows 1..3 of the cp.async ring (nvcc 13.0, sm_90: 156 / 273 / 402 instructions per
// token of a unit at rounding 0, 180 / 321 / 466 at rounding 1, 168 / 297 / 430 at rounding 2;
// per token the ring adds a copy and a shared load per 16 B and the commit and wait; prologue +
// epilogue 290 / 313 for rows 2 / 3, the ring's first two groups included, and each weight's load
// a select between its activation-type and float32 forms (docs/spec.md 3.4): 216 / 236 / 258 for
// rows 1 / 2 / 3 before the float32 weights; perGroup is rows 2's).
constexpr FastIssueCost kFastIssueCost[] = {{15.3, 33.6, 290.0}, {17.8, 37.6, 290.0}, {16.3, 37.6, 290.0}};

// NeoX pairing (interleaved = false: pair j = (y[j], y[j + rotary_dim / 2])) costs more per token of a
// unit than interleaved pairs at every rounding: the partner of a thread's element lives in another
// lane's chunk, so the rotation exchanges halves across lanes. Measured on the same sm_90 SASS
// (bf16; head_dim 128 and 256 alike): +24.0 instructions per token at rows 1 and +29.3 at rows 2,
// every rounding mode; one constant per token between the two (within 3 instructions of each).
constexpr double kFastNeoxPerToken = 27.0;

inline FastIssueCost fastIssueCost(int rounding)
{
    constexpr int kModes = static_cast<int>(sizeof(kFastIssueCost) / sizeof(kFastIssueCost[0]));
    return kFastIssueCost[rounding >= 0 && rounding < kModes ? rounding : 0];
}

struct FastProblem
{
    int64_t numTokens;
    int64_t numHeads;
    int headDim;
    int rotaryDim;
    int elemBytes;
    int rounding;
    bool interleaved = true; // pairing (kFastNeoxPerToken where false)
};

struct FastEstimate
{
    int rows = 0;
    TokenSplit split{0, 0};
    int64_t unitsPerToken = 0;
    int64_t rounds = 0;
    int64_t blocksPerSm = 0;        // resident blocks per SM (occupancy)
    double bytesInFlightPerSm = 0;  // q/k reads outstanding per SM past every wait (kPrefetch groups)
    double instrPerElement = 0;     // common-path instructions per element of the busiest group
    double issueRoundNs = 0;
    double memoryRoundNs = 0;
    double timeNs = 0;
};

inline FastEstimate estimateFast(FastProblem const& p, int rows, int64_t residentBlocksPerSm, DeviceModel const& d)
{
    FastEstimate e;
    int const lanes = fastLanes(p.headDim, p.elemBytes);
    int const elems = fastChunksPerThread(p.headDim, p.elemBytes) * fastVec(p.elemBytes);
    int64_t const groupsPerBlock = kPlanThreads / lanes;
    e.rows = rows;
    e.blocksPerSm = residentBlocksPerSm > 0 ? residentBlocksPerSm : 1;
    e.unitsPerToken = 2 * ceilDiv(p.numHeads, rows);
    e.split = splitTokens(p.numTokens, e.unitsPerToken, groupsPerBlock, e.blocksPerSm * d.sms);
    e.rounds = ceilDiv(p.numTokens, e.split.tokenStep);
    int64_t const busiestBlocks = ceilDiv(e.split.blocks, d.sms);
    double const threads = static_cast<double>(busiestBlocks) * kPlanThreads;
    double const warps = threads / 32.0;
    FastIssueCost const c = fastIssueCost(p.rounding);
    double const perToken = rows * elems * c.perElement + c.perToken + (p.interleaved ? 0.0 : kFastNeoxPerToken);
    double const issueRate = d.schedulersPerSm * d.clockGHz; // warp-instructions per ns per SM
    e.issueRoundNs = warps * perToken / issueRate;
    double const readBytes = threads * rows * elems * p.elemBytes;
    double const cacheBytes = static_cast<double>(e.split.tokenStep) * p.rotaryDim * 4.0 / d.sms;
    double const bytes = 2.0 * readBytes + cacheBytes;
    int64_t const depth = e.rounds < kPlanPrefetch ? e.rounds : kPlanPrefetch;
    double const atPeak = bytes / (d.dramBytesPerNs / d.sms);
    double const latencyBound = kLatencyMargin * d.latencyNs * bytes / (static_cast<double>(depth) * readBytes);
    e.memoryRoundNs = atPeak > latencyBound ? atPeak : latencyBound;
    double const roundNs = e.issueRoundNs > e.memoryRoundNs ? e.issueRoundNs : e.memoryRoundNs;
    e.timeNs = d.latencyNs + warps * c.perGroup / issueRate + e.rounds * roundNs + e.issueRoundNs;
    e.bytesInFlightPerSm = static_cast<double>(e.blocksPerSm) * kPlanThreads * depth * rows
        * fastChunksPerThread(p.headDim, p.elemBytes) * 16.0;
    double const tokensPerGroup = static_cast<double>(p.numTokens) / e.split.tokenStep;
    e.instrPerElement = (tokensPerGroup * perToken + c.perGroup) / (tokensPerGroup * rows * elems);
    return e;
}

// The plan's choice among the candidates rows = 1..maxRows (residentBlocksPerSm[rows - 1] from the
// occupancy query of each instance): the least estimated time, ties to more rows.
inline FastEstimate planFast(FastProblem const& p, int maxRows, int64_t const* residentBlocksPerSm, DeviceModel const& d)
{
    FastEstimate best;
    for (int rows = maxRows; rows >= 1; --rows)
    {
        FastEstimate const e = estimateFast(p, rows, residentBlocksPerSm[rows - 1], d);
        if (best.rows == 0 || e.timeNs < best.timeNs)
        {
            best = e;
        }
    }
    return best;
}

// ---------------------------------------------------------------------------------------------
// The launch plan of the norm_scope 1 fast path (qkNormRopeRowKernel): which rows per group (the
// largest instance or half of it, each where rowFits), so which block size. The model is planFast's,
// with a block as the unit: a block owns one (token, q/k) row, so the grid is splitTokens(tokens, 2,
// 1, resident blocks); per token a thread issues rows x its elements at the per-element cost and the
// per-token cost (kRowIssueCost below: the cross-head reduction included), and every thread of the block
// issues, including the groups past num_heads (rows x groups - heads idle rows). The bytes are the
// row's: the idle rows are neither read nor written.
// Common-path instructions of one thread of the row kernel, by rounding mode: per element of its rows,
// per token (cos/sin, the ring, the head sums: the store, the barrier, the loads and adds, the
// butterfly, the division), and per thread outside the loop (prologue + epilogue: perGroup +
// perGroupRow x rows, the weights of each row loaded and converted once). Measured on the sm_90 SASS
// of the bf16, head_dim 128, interleaved, full-rotary instances (nvcc 13.0; scripts/kernel_report.py):
// per token 306 / 516 instructions at rows 2 / 4 with rounding 0, 312 / 556 with rounding 2;
// prologue + epilogue 344 / 527 at rounding 2 (each weight's load a select between its
// activation-type and float32 forms; 317 / 452 before). Rounding 1 is not measured: rounding 2's
// figures plus the per-element difference of the per-head kernel (kFastIssueCost: +1.5).
struct RowIssueCost
{
    double perElement;
    double perToken;
    double perGroup;
    double perGroupRow;
};

constexpr RowIssueCost kRowIssueCost[] = {{13.14, 95.7, 161.0, 91.5}, {16.75, 68.3, 161.0, 91.5},
    {15.25, 68.3, 161.0, 91.5}};

inline RowIssueCost rowIssueCost(int rounding)
{
    constexpr int kModes = static_cast<int>(sizeof(kRowIssueCost) / sizeof(kRowIssueCost[0]));
    return kRowIssueCost[rounding >= 0 && rounding < kModes ? rounding : 0];
}

struct RowEstimate
{
    int rows = 0;
    int64_t threads = 0;            // block size
    TokenSplit split{0, 0};
    int64_t rounds = 0;
    int64_t blocksPerSm = 0;
    double bytesInFlightPerSm = 0;  // q/k reads outstanding per SM past every wait (kPrefetch tokens)
    double instrPerElement = 0;     // common-path instructions per element of the row (idle threads included)
    double issueRoundNs = 0;
    double memoryRoundNs = 0;
    double timeNs = 0;
};

inline RowEstimate estimateRow(FastProblem const& p, int rows, int64_t residentBlocksPerSm, DeviceModel const& d)
{
    RowEstimate e;
    int const lanes = fastLanes(p.headDim, p.elemBytes);
    int const elems = fastChunksPerThread(p.headDim, p.elemBytes) * fastVec(p.elemBytes);
    e.rows = rows;
    e.threads = rowThreads(p.numHeads, rows, lanes);
    e.blocksPerSm = residentBlocksPerSm > 0 ? residentBlocksPerSm : 1;
    e.split = splitTokens(p.numTokens, 2, 1, e.blocksPerSm * d.sms);
    e.rounds = ceilDiv(p.numTokens, e.split.tokenStep);
    int64_t const busiestBlocks = ceilDiv(e.split.blocks, d.sms);
    double const warps = static_cast<double>(busiestBlocks) * e.threads / 32.0;
    RowIssueCost const c = rowIssueCost(p.rounding);
    double const perToken = rows * elems * c.perElement + c.perToken;
    double const perGroup = c.perGroup + c.perGroupRow * rows;
    double const issueRate = d.schedulersPerSm * d.clockGHz;
    e.issueRoundNs = warps * perToken / issueRate;
    double const rowBytes = static_cast<double>(p.numHeads) * p.headDim * p.elemBytes;
    double const readBytes = busiestBlocks * rowBytes;
    double const cacheBytes = static_cast<double>(e.split.tokenStep) * p.rotaryDim * 4.0 / d.sms;
    double const bytes = 2.0 * readBytes + cacheBytes;
    int64_t const depth = e.rounds < kPlanPrefetch ? e.rounds : kPlanPrefetch;
    double const atPeak = bytes / (d.dramBytesPerNs / d.sms);
    double const latencyBound = kLatencyMargin * d.latencyNs * bytes / (static_cast<double>(depth) * readBytes);
    e.memoryRoundNs = atPeak > latencyBound ? atPeak : latencyBound;
    double const roundNs = e.issueRoundNs > e.memoryRoundNs ? e.issueRoundNs : e.memoryRoundNs;
    e.timeNs = d.latencyNs + warps * perGroup / issueRate + e.rounds * roundNs + e.issueRoundNs;
    e.bytesInFlightPerSm = static_cast<double>(e.blocksPerSm) * depth * rowBytes;
    double const tokensPerBlock = static_cast<double>(p.numTokens) / e.split.tokenStep;
    e.instrPerElement = (tokensPerBlock * perToken + perGroup) * e.threads
        / (tokensPerBlock * static_cast<double>(p.numHeads) * p.headDim);
    return e;
}

// The plan's choice among rows = maxRows and maxRows / 2 (where they fit one block; the resident
// blocks per SM of each at its block size from the occupancy query): the least estimated time,
// ties to more rows.
inline RowEstimate planRow(FastProblem const& p, int maxRows, int64_t const* residentBlocksPerSm, DeviceModel const& d)
{
    RowEstimate best;
    int const candidates[2] = {maxRows, maxRows / 2};
    for (int k = 0; k < 2; ++k)
    {
        int const rows = candidates[k];
        if (rows < 1 || !rowFits(p.numHeads, rows, p.headDim, p.elemBytes))
        {
            continue;
        }
        RowEstimate const e = estimateRow(p, rows, residentBlocksPerSm[k], d);
        if (best.rows == 0 || e.timeNs < best.timeNs)
        {
            best = e;
        }
    }
    return best;
}

} // namespace qkrope
