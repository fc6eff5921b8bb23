// SIMT emulation: the warp collectives and __syncthreads. A lane arriving at a collective is
// checked (its own mask, the width, the lanes it waits for, a matching collective of the other
// lanes) and waits; the last lane to arrive (or to exit, for lanes that need not take part)
// computes every participant's result from the values the lanes contributed. The intrinsics'
// names, kinds and result rules are one table (kOps).
#include "simt_internal.h"

#include <cstdio>

namespace simt
{
namespace internal
{

namespace
{

using detail::Op;

// The results of a complete collective: results[i] and preds[i] for every lane i of `mask` (the
// lanes of p.mask that arrived); `exited`: the lanes of p.mask that exited instead (or do not exist).
using Combine = void (*)(Worker& w, int warpIndex, Pending const& p, unsigned mask, unsigned exited,
    uint64_t* results, int* preds);

void combineNothing(Worker&, int, Pending const&, unsigned, unsigned, uint64_t*, int*) {}

// PTX shfl.sync with c = ((32 - width) << 8) | clamp (clamp 0 for up, 0x1f otherwise).
void combineShuffle(Worker& w, int warpIndex, Pending const& p, unsigned mask, unsigned exited, uint64_t* results,
    int*)
{
    int const segmask = (32 - p.width) & 0x1F;
    int const clamp = p.op == Op::ShflUp ? 0 : 0x1F;
    for (int i = 0; i < 32; ++i)
    {
        if (!((mask >> i) & 1U))
        {
            continue;
        }
        int const b = p.arg[i] & 0x1F;
        int const maxLane = (i & segmask) | (clamp & ~segmask);
        int const minLane = i & segmask;
        int j = i;
        bool inRange = false;
        switch (p.op)
        {
        case Op::ShflUp: j = i - b; inRange = j >= maxLane; break;
        case Op::ShflDown: j = i + b; inRange = j <= maxLane; break;
        case Op::ShflXor: j = i ^ b; inRange = j <= maxLane; break;
        default: j = minLane | (b & ~segmask); inRange = j <= maxLane; break;
        }
        if (!inRange)
        {
            j = i;
        }
        if (!((mask >> j) & 1U))
        {
            failFiber(w, cudaErrorLaunchFailure,
                std::string(opName(p.op)) + "(mask " + hex(p.mask) + ", width " + std::to_string(p.width) + ") at "
                    + where(p.loc) + " in warp " + std::to_string(warpIndex) + ": lane " + std::to_string(i)
                    + " reads lane " + std::to_string(j)
                    + (((exited >> j) & 1U) ? ", which exited without taking part (a lane skipped the shuffle; "
                                              "the value is undefined on the device)"
                                            : ", which is not in the mask (undefined on the device)"));
        }
        results[i] = p.value[j];
    }
}

// __ballot_sync, __any_sync, __all_sync: the same result for every lane.
void combineVote(Worker&, int, Pending const& p, unsigned mask, unsigned, uint64_t* results, int*)
{
    unsigned ballot = 0;
    for (int i = 0; i < 32; ++i)
    {
        if (((mask >> i) & 1U) && p.value[i] != 0)
        {
            ballot |= 1U << i;
        }
    }
    uint64_t const r = p.op == Op::Ballot ? ballot : (p.op == Op::Any ? (ballot != 0) : (ballot == mask));
    for (int i = 0; i < 32; ++i)
    {
        results[i] = r;
    }
}

// __match_any_sync: the lanes with this lane's value; __match_all_sync: the mask (and *pred 1)
// when every participant has the same value, else 0 (and *pred 0).
void combineMatch(Worker&, int, Pending const& p, unsigned mask, unsigned, uint64_t* results, int* preds)
{
    bool all = true;
    int firstLane = __builtin_ctz(mask);
    for (int i = 0; i < 32; ++i)
    {
        if (!((mask >> i) & 1U))
        {
            continue;
        }
        unsigned same = 0;
        for (int j = 0; j < 32; ++j)
        {
            if (((mask >> j) & 1U) && p.value[j] == p.value[i])
            {
                same |= 1U << j;
            }
        }
        results[i] = same;
        all = all && p.value[i] == p.value[firstLane];
    }
    if (p.op == Op::MatchAll)
    {
        for (int i = 0; i < 32; ++i)
        {
            results[i] = all ? p.mask : 0U;
            preds[i] = all ? 1 : 0;
        }
    }
}

// __reduce_*_sync on the low 32 bits of the participants' values, in lane order.
uint32_t reduceAdd(uint32_t acc, uint32_t v)
{
    return acc + v;
}
uint32_t reduceMinU(uint32_t acc, uint32_t v)
{
    return v < acc ? v : acc;
}
uint32_t reduceMaxU(uint32_t acc, uint32_t v)
{
    return v > acc ? v : acc;
}
uint32_t reduceMinS(uint32_t acc, uint32_t v)
{
    return static_cast<int32_t>(v) < static_cast<int32_t>(acc) ? v : acc;
}
uint32_t reduceMaxS(uint32_t acc, uint32_t v)
{
    return static_cast<int32_t>(v) > static_cast<int32_t>(acc) ? v : acc;
}
uint32_t reduceAnd(uint32_t acc, uint32_t v)
{
    return acc & v;
}
uint32_t reduceOr(uint32_t acc, uint32_t v)
{
    return acc | v;
}
uint32_t reduceXor(uint32_t acc, uint32_t v)
{
    return acc ^ v;
}

template <uint32_t (*kStep)(uint32_t, uint32_t)>
void combineReduce(Worker&, int, Pending const& p, unsigned mask, unsigned, uint64_t* results, int*)
{
    uint32_t acc = 0;
    bool first = true;
    for (int i = 0; i < 32; ++i)
    {
        if (!((mask >> i) & 1U))
        {
            continue;
        }
        uint32_t const v = static_cast<uint32_t>(p.value[i]);
        if (first)
        {
            acc = v;
            first = false;
            continue;
        }
        acc = kStep(acc, v);
    }
    for (int i = 0; i < 32; ++i)
    {
        results[i] = acc;
    }
}

struct OpInfo
{
    Op op;
    char const* name; // the intrinsic, as messages spell it
    bool shuffle;     // takes a width
    Combine combine;
};

// One row per detail::Op, in the enum's order.
constexpr OpInfo kOps[] = {
    {Op::SyncWarp, "__syncwarp", false, combineNothing},
    {Op::ShflIdx, "__shfl_sync", true, combineShuffle},
    {Op::ShflUp, "__shfl_up_sync", true, combineShuffle},
    {Op::ShflDown, "__shfl_down_sync", true, combineShuffle},
    {Op::ShflXor, "__shfl_xor_sync", true, combineShuffle},
    {Op::Ballot, "__ballot_sync", false, combineVote},
    {Op::Any, "__any_sync", false, combineVote},
    {Op::All, "__all_sync", false, combineVote},
    {Op::MatchAny, "__match_any_sync", false, combineMatch},
    {Op::MatchAll, "__match_all_sync", false, combineMatch},
    {Op::ReduceAddU, "__reduce_add_sync", false, combineReduce<reduceAdd>},
    {Op::ReduceMinU, "__reduce_min_sync", false, combineReduce<reduceMinU>},
    {Op::ReduceMaxU, "__reduce_max_sync", false, combineReduce<reduceMaxU>},
    {Op::ReduceAddS, "__reduce_add_sync", false, combineReduce<reduceAdd>},
    {Op::ReduceMinS, "__reduce_min_sync", false, combineReduce<reduceMinS>},
    {Op::ReduceMaxS, "__reduce_max_sync", false, combineReduce<reduceMaxS>},
    {Op::ReduceAnd, "__reduce_and_sync", false, combineReduce<reduceAnd>},
    {Op::ReduceOr, "__reduce_or_sync", false, combineReduce<reduceOr>},
    {Op::ReduceXor, "__reduce_xor_sync", false, combineReduce<reduceXor>},
};
constexpr std::size_t kNumOps = sizeof(kOps) / sizeof(kOps[0]);

constexpr bool tableInEnumOrder()
{
    for (std::size_t i = 0; i < kNumOps; ++i)
    {
        if (static_cast<std::size_t>(kOps[i].op) != i)
        {
            return false;
        }
    }
    return kNumOps == static_cast<std::size_t>(Op::ReduceXor) + 1;
}
static_assert(tableInEnumOrder(), "kOps: one row per detail::Op, in the enum's order");

OpInfo const* infoOf(Op op)
{
    auto const i = static_cast<std::size_t>(op);
    return i < kNumOps ? &kOps[i] : nullptr;
}

} // namespace

char const* opName(Op op)
{
    OpInfo const* info = infoOf(op);
    return info != nullptr ? info->name : "?";
}

bool isShuffle(Op op)
{
    OpInfo const* info = infoOf(op);
    return info != nullptr && info->shuffle;
}

char const* baseName(char const* path)
{
    char const* s = std::strrchr(path != nullptr ? path : "?", '/');
    return s != nullptr ? s + 1 : (path != nullptr ? path : "?");
}

std::string laneList(unsigned bits)
{
    std::string s = "{";
    bool first = true;
    for (int i = 0; i < 32; ++i)
    {
        if ((bits >> i) & 1U)
        {
            // compress runs: a..b
            int j = i;
            while (j + 1 < 32 && ((bits >> (j + 1)) & 1U))
            {
                ++j;
            }
            s += first ? "" : ",";
            s += std::to_string(i);
            if (j > i)
            {
                s += ".." + std::to_string(j);
            }
            first = false;
            i = j;
        }
    }
    return s + "}";
}

std::string hex(unsigned v)
{
    char buf[16];
    std::snprintf(buf, sizeof(buf), "0x%08X", v);
    return buf;
}

std::string where(detail::Loc loc)
{
    return std::string(baseName(loc.file)) + ":" + std::to_string(loc.line);
}

std::string describeLane(Worker const& w, int warp, int lane)
{
    int const tid = warp * 32 + lane;
    if (tid >= w.nthreads)
    {
        return "does not exist";
    }
    Fiber const& f = w.fibers[static_cast<std::size_t>(tid)];
    switch (f.state)
    {
    case FState::Exited: return "exited";
    case FState::WaitBlock: return "waits at __syncthreads (" + where(f.waitLoc) + ")";
    case FState::WaitWarp:
        return std::string("waits at ") + opName(f.waitOp) + "(mask " + hex(f.waitMask) + ") (" + where(f.waitLoc) + ")";
    case FState::Ready: return "is ready";
    case FState::Running: return "is running";
    }
    return "?";
}

std::string describePending(Worker const& w, int warp, Pending const& p)
{
    std::string s = std::string(opName(p.op)) + "(mask " + hex(p.mask) + (isShuffle(p.op) ? ", width " + std::to_string(p.width) : "")
        + ") at " + where(p.loc) + ": lanes " + laneList(p.arrived) + " arrived, missing";
    WarpState const& ws = w.warps[static_cast<std::size_t>(warp)];
    unsigned const missing = p.mask & ~p.arrived & ws.existing & ~ws.exited;
    for (int l = 0; l < 32; ++l)
    {
        if ((missing >> l) & 1U)
        {
            s += " lane " + std::to_string(l) + " (" + describeLane(w, warp, l) + ");";
        }
    }
    return s;
}

void completeCollective(Worker& w, int warpIndex, Pending& p)
{
    // The participants: the lanes of the mask that arrived (lanes of the mask that exited, or do
    // not exist, take no part: CUDA requires only the non-exited threads named in the mask).
    unsigned const mask = p.arrived;
    unsigned const exited = p.mask & ~p.arrived;
    uint64_t results[32] = {};
    int preds[32] = {};
    kOps[static_cast<std::size_t>(p.op)].combine(w, warpIndex, p, mask, exited, results, preds); // a row per Op
    for (int i = 0; i < 32; ++i)
    {
        if ((mask >> i) & 1U)
        {
            Fiber& f = w.fibers[static_cast<std::size_t>(warpIndex * 32 + i)];
            f.result = results[i];
            f.pred = preds[i];
            if (&f != w.current)
            {
                makeReady(w, f);
            }
        }
    }
}

} // namespace internal

namespace detail
{

using namespace internal;

uint64_t collective(Op op, unsigned mask, uint64_t value, int arg, int width, int size, Loc loc, int* pred)
{
    Worker& w = tlWorker;
    if (w.current == nullptr)
    {
        std::fprintf(stderr, "simt: %s called outside an emulated kernel launch (%s)\n", opName(op), where(loc).c_str());
        std::abort();
    }
    Fiber& f = *w.current;
    ++w.collectives;
    WarpState& ws = w.warps[static_cast<std::size_t>(f.warp)];
    unsigned const bit = 1U << f.lane;
    std::string const call = std::string(opName(op)) + "(mask " + hex(mask)
        + (isShuffle(op) ? ", width " + std::to_string(width) : "") + ") at " + where(loc);
    if (!(mask & bit))
    {
        failFiber(w, cudaErrorLaunchFailure, call + ": the calling lane is not in its own mask");
    }
    if (isShuffle(op) && (width < 1 || width > 32 || (width & (width - 1)) != 0))
    {
        failFiber(w, cudaErrorLaunchFailure, call + ": width must be a power of two in [1, 32]");
    }
    if (w.strictExit && (mask & ~ws.existing))
    {
        failFiber(w, cudaErrorLaunchFailure, call + " (strict): the mask names lanes " + laneList(mask & ~ws.existing)
            + " that do not exist in this warp (block size " + std::to_string(w.nthreads) + ")");
    }
    if (w.strictExit && (mask & ws.exited))
    {
        failFiber(w, cudaErrorLaunchFailure, "deadlock (strict): " + call + " names lanes " + laneList(mask & ws.exited)
            + " that already exited");
    }
    for (int l = 0; l < 32; ++l)
    {
        if (((mask >> l) & 1U) && w.fibers[static_cast<std::size_t>(f.warp * 32 + l)].state == FState::WaitBlock)
        {
            failFiber(w, cudaErrorLaunchFailure, "deadlock: " + call + " waits for lane " + std::to_string(l)
                + ", which " + describeLane(w, f.warp, l));
        }
    }
    Pending* p = nullptr;
    for (Pending& q : ws.pending)
    {
        if (q.mask == mask && !(q.arrived & bit))
        {
            p = &q;
            break;
        }
    }
    if (p != nullptr)
    {
        if (p->op != op || p->width != width || p->size != size)
        {
            failFiber(w, cudaErrorLaunchFailure, "mismatched collective: " + call + " (" + std::to_string(size)
                + "-byte value) while " + describePending(w, f.warp, *p) + " (" + std::to_string(p->size) + "-byte value)");
        }
    }
    else
    {
        for (Pending const& q : ws.pending)
        {
            if ((q.mask & bit) && !(q.arrived & bit))
            {
                failFiber(w, cudaErrorLaunchFailure, "mismatched collective: " + call + " while " + describePending(w, f.warp, q));
            }
        }
        ws.pending.push_back(Pending{op, mask, width, size, 0U, loc, {}, {}});
        p = &ws.pending.back();
    }
    p->arrived |= bit;
    p->value[f.lane] = value;
    p->arg[f.lane] = arg;
    unsigned const gone = ~ws.existing | ws.exited;
    if (((p->arrived | gone) & mask) == mask)
    {
        Pending done = *p;
        ws.pending.erase(ws.pending.begin() + (p - ws.pending.data()));
        completeCollective(w, f.warp, done);
        yieldIfRandom(w);
    }
    else
    {
        f.state = FState::WaitWarp;
        f.waitOp = op;
        f.waitMask = mask;
        f.waitLoc = loc;
        suspend(w);
    }
    if (pred != nullptr)
    {
        *pred = f.pred;
    }
    return f.result;
}

void syncThreads(Loc loc)
{
    Worker& w = tlWorker;
    if (w.current == nullptr)
    {
        std::fprintf(stderr, "simt: __syncthreads called outside an emulated kernel launch (%s)\n", where(loc).c_str());
        std::abort();
    }
    Fiber& f = *w.current;
    ++w.barriers;
    if (w.exitedCount > 0)
    {
        failFiber(w, cudaErrorLaunchFailure, "deadlock: __syncthreads at " + where(loc) + " after "
            + std::to_string(w.exitedCount) + " thread(s) of the block exited");
    }
    WarpState const& ws = w.warps[static_cast<std::size_t>(f.warp)];
    unsigned const bit = 1U << f.lane;
    for (Pending const& p : ws.pending)
    {
        if ((p.mask & bit) && !(p.arrived & bit))
        {
            failFiber(w, cudaErrorLaunchFailure, "deadlock: __syncthreads at " + where(loc) + " while "
                + describePending(w, f.warp, p));
        }
    }
    if (w.barrierCount == 0)
    {
        w.barrierLoc = loc;
    }
    if (++w.barrierCount == w.nthreads)
    {
        w.barrierCount = 0;
        for (Fiber& o : w.fibers)
        {
            if (&o - w.fibers.data() >= w.nthreads)
            {
                break;
            }
            if (o.state == FState::WaitBlock)
            {
                makeReady(w, o);
            }
        }
        yieldIfRandom(w);
        return;
    }
    f.state = FState::WaitBlock;
    f.waitLoc = loc;
    suspend(w);
}

unsigned activeMask()
{
    Worker& w = tlWorker;
    if (w.current == nullptr)
    {
        return 1U;
    }
    WarpState const& ws = w.warps[static_cast<std::size_t>(w.current->warp)];
    return ws.existing & ~ws.exited;
}

} // namespace detail
} // namespace simt
