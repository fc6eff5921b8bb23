// SIMT emulation: the fiber scheduler. What is emulated and what is not: see simt.h.
//
// Execution: a launch runs its blocks one after another on the calling OS thread. For each block
// every CUDA thread becomes a fiber (ucontext; stacks from one mmap'ed region per OS thread, a
// PROT_NONE guard page below each). A fiber runs until it reaches a sync point (a warp collective
// or __syncthreads) that cannot complete yet, or exits; the scheduler then resumes another ready
// fiber (FIFO = round-robin, or a seeded random pick). The last lane to arrive at a collective
// computes every participant's result and makes them ready. When no fiber is ready and some have
// not exited, the block is deadlocked: that (and every other misuse the collectives detect) ends
// the launch with an error and a message; the abandoned fibers are never resumed.
#include "simt_internal.h"

#include <unistd.h>

#include <cstdio>

thread_local uint3 threadIdx;
thread_local uint3 blockIdx;
thread_local dim3 blockDim;
thread_local dim3 gridDim;

namespace simt
{
namespace internal
{

thread_local Worker tlWorker;

namespace
{

std::size_t pageSize()
{
    static std::size_t const p = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
    return p;
}

bool ensureStacks(Worker& w, int n, std::size_t stackBytes)
{
    std::size_t const page = pageSize();
    stackBytes = (stackBytes + page - 1) / page * page;
    if (w.capacity >= n && w.stackBytes == stackBytes)
    {
        return true;
    }
    if (w.region != nullptr)
    {
        munmap(w.region, w.regionBytes);
        w.region = nullptr;
        w.capacity = 0;
    }
    std::size_t const slot = stackBytes + page;
    std::size_t const bytes = slot * static_cast<std::size_t>(n);
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED)
    {
        return false;
    }
    w.region = static_cast<char*>(p);
    w.regionBytes = bytes;
    w.stackBytes = stackBytes;
    w.capacity = n;
    for (int i = 0; i < n; ++i)
    {
        mprotect(w.region + slot * static_cast<std::size_t>(i), page, PROT_NONE); // guard below each stack
    }
    w.fibers.resize(static_cast<std::size_t>(n));
    return true;
}

char* stackOf(Worker& w, int i)
{
    return w.region + (w.stackBytes + pageSize()) * static_cast<std::size_t>(i) + pageSize();
}

} // namespace

std::string blockText(Worker const& w)
{
    char buf[160];
    std::snprintf(buf, sizeof(buf), "block (%u,%u,%u) of grid (%u,%u,%u), block dim (%u,%u,%u)", blockIdx.x,
        blockIdx.y, blockIdx.z, w.grid.x, w.grid.y, w.grid.z, w.block.x, w.block.y, w.block.z);
    return buf;
}

void failFiber(Worker& w, cudaError_t code, std::string const& what)
{
    if (!w.failed)
    {
        w.failed = true;
        w.error = code;
        w.message = "kernel " + w.kernel + ", " + blockText(w);
        if (w.current != nullptr)
        {
            w.message += ", thread " + std::to_string(w.current->tid) + " (warp " + std::to_string(w.current->warp)
                + ", lane " + std::to_string(w.current->lane) + ")";
        }
        w.message += ": " + what;
    }
    Fiber* f = w.current;
    swapcontext(&f->ctx, &w.sched);
    std::abort(); // a failed fiber is never resumed
}

void makeReady(Worker& w, Fiber& f)
{
    f.state = FState::Ready;
    if (w.random)
    {
        w.readyPool.push_back(f.tid);
    }
    else
    {
        w.readyFifo.push_back(f.tid);
    }
}

void suspend(Worker& w)
{
    Fiber* f = w.current;
    swapcontext(&f->ctx, &w.sched);
    // resumed by the scheduler: w.current == f, threadIdx restored
}

void yieldIfRandom(Worker& w)
{
    if (w.random)
    {
        makeReady(w, *w.current);
        suspend(w);
    }
}

namespace
{

void onFiberExit(Worker& w)
{
    Fiber& f = *w.current;
    f.state = FState::Exited;
    ++w.exitedCount;
    WarpState& ws = w.warps[static_cast<std::size_t>(f.warp)];
    unsigned const bit = 1U << f.lane;
    ws.exited |= bit;
    if (w.strictExit)
    {
        for (Pending const& p : ws.pending)
        {
            if ((p.mask & bit) && !(p.arrived & bit))
            {
                failFiber(w, cudaErrorLaunchFailure,
                    "deadlock (strict): the lane exited while " + describePending(w, f.warp, p));
            }
        }
    }
    // CUDA: only the non-exited lanes of a mask must arrive. Complete what waited only for this lane.
    for (std::size_t i = 0; i < ws.pending.size();)
    {
        Pending& p = ws.pending[i];
        unsigned const gone = ~ws.existing | ws.exited;
        if ((p.mask & bit) && ((p.arrived | gone) & p.mask) == p.mask)
        {
            Pending done = p;
            ws.pending.erase(ws.pending.begin() + static_cast<std::ptrdiff_t>(i));
            completeCollective(w, f.warp, done);
            continue;
        }
        ++i;
    }
    if (w.barrierCount > 0)
    {
        failFiber(w, cudaErrorLaunchFailure,
            "deadlock: the thread exited while " + std::to_string(w.barrierCount) + " thread(s) wait at __syncthreads ("
                + where(w.barrierLoc) + ")");
    }
}

void fiberEntry()
{
    Worker& w = tlWorker;
    w.body.call(w.body.self);
    onFiberExit(w);
    swapcontext(&w.current->ctx, &w.sched);
    std::abort();
}


// Runs one block; returns false when the launch failed.
bool runBlock(Worker& w)
{
    int const n = w.nthreads;
    int const nwarps = (n + 31) / 32;
    w.warps.assign(static_cast<std::size_t>(nwarps), WarpState{});
    for (int i = 0; i < nwarps; ++i)
    {
        int const lanes = std::min(32, n - 32 * i);
        w.warps[static_cast<std::size_t>(i)].existing = lanes == 32 ? 0xFFFFFFFFU : ((1U << lanes) - 1U);
    }
    w.barrierCount = 0;
    w.exitedCount = 0;
    w.readyFifo.clear();
    w.readyPool.clear();
    for (int t = 0; t < n; ++t)
    {
        Fiber& f = w.fibers[static_cast<std::size_t>(t)];
        getcontext(&f.ctx);
        f.ctx.uc_stack.ss_sp = stackOf(w, t);
        f.ctx.uc_stack.ss_size = w.stackBytes;
        f.ctx.uc_link = &w.sched;
        makecontext(&f.ctx, fiberEntry, 0);
        f.tid = t;
        f.warp = t / 32;
        f.lane = t % 32;
        f.idx = uint3{static_cast<unsigned>(t) % w.block.x, (static_cast<unsigned>(t) / w.block.x) % w.block.y,
            static_cast<unsigned>(t) / (w.block.x * w.block.y)};
        f.result = 0;
        f.pred = 0;
        f.asyncOpen.clear();   // a block's copies never land in the next block's shared memory
        f.asyncGroups.clear();
        makeReady(w, f);
    }
    while (!w.failed)
    {
        int next = -1;
        if (w.random)
        {
            if (!w.readyPool.empty())
            {
                std::size_t const k = static_cast<std::size_t>(w.rng() % w.readyPool.size());
                next = w.readyPool[k];
                w.readyPool[k] = w.readyPool.back();
                w.readyPool.pop_back();
            }
        }
        else if (!w.readyFifo.empty())
        {
            next = w.readyFifo.front();
            w.readyFifo.pop_front();
        }
        if (next < 0)
        {
            if (w.exitedCount == n)
            {
                return true;
            }
            // Safety net: nothing can run and not everything has exited.
            w.failed = true;
            w.error = cudaErrorLaunchFailure;
            w.message = "kernel " + w.kernel + ", " + blockText(w) + ": deadlock: no thread can make progress;";
            for (int wi = 0; wi < nwarps; ++wi)
            {
                for (Pending const& p : w.warps[static_cast<std::size_t>(wi)].pending)
                {
                    w.message += " warp " + std::to_string(wi) + ": " + describePending(w, wi, p);
                }
            }
            if (w.barrierCount > 0)
            {
                w.message += " " + std::to_string(w.barrierCount) + " thread(s) wait at __syncthreads ("
                    + where(w.barrierLoc) + ")";
            }
            return false;
        }
        Fiber& f = w.fibers[static_cast<std::size_t>(next)];
        f.state = FState::Running;
        w.current = &f;
        threadIdx = f.idx;
        swapcontext(&w.sched, &f.ctx);
        w.current = nullptr;
    }
    return false;
}

} // namespace
} // namespace internal

namespace detail
{

using namespace internal;

bool inKernel()
{
    return tlWorker.current != nullptr;
}

void fault(cudaError_t code, char const* what, void const* address, Loc loc)
{
    Worker& w = tlWorker;
    char buf[64];
    std::snprintf(buf, sizeof(buf), "%p", address);
    std::string const text = std::string(what) + " at " + where(loc) + ": address " + buf
        + (code == cudaErrorMisalignedAddress ? " is misaligned for the access" : "");
    if (w.current == nullptr)
    {
        std::fprintf(stderr, "simt: %s (outside a kernel)\n", text.c_str());
        std::abort();
    }
    failFiber(w, code, text);
}

cudaError_t launch(void const* kernel, char const* signature, dim3 grid, dim3 block, std::size_t smem,
    cudaStream_t /*stream*/, Body body)
{
    Worker& w = tlWorker;
    if (w.inLaunch)
    {
        return setLastError(cudaErrorNotSupported); // no dynamic parallelism
    }
    uint64_t const threads = static_cast<uint64_t>(block.x) * block.y * block.z;
    if (grid.x == 0 || grid.y == 0 || grid.z == 0 || grid.x > 0x7FFFFFFFU || grid.y > 65535 || grid.z > 65535
        || threads == 0 || threads > 1024 || block.x > 1024 || block.y > 1024 || block.z > 64)
    {
        return setLastError(cudaErrorInvalidConfiguration);
    }
    DeviceConfig cfg;
    int device;
    uint64_t seed;
    std::size_t stackBytes;
    bool dryRun;
    {
        std::lock_guard<std::mutex> lock(G().mu);
        w.kernel = kernelName(kernel, signature);
        device = G().current;
        cfg = configOf(device);
        seed = G().seed;
        stackBytes = G().stackSize;
        dryRun = G().dryRun;
        w.strictExit = G().strictExit;
    }
    LaunchRecord rec{};
    rec.kernel = w.kernel;
    rec.grid = grid;
    rec.block = block;
    rec.smem = smem;
    rec.device = device;
    rec.config = cfg;
    rec.seed = seed;
    if (dryRun)
    {
        std::lock_guard<std::mutex> lock(G().mu);
        recordLocked(std::move(rec));
        return cudaSuccess;
    }
    if (!ensureStacks(w, static_cast<int>(threads), stackBytes))
    {
        return setLastError(cudaErrorMemoryAllocation);
    }
    w.inLaunch = true;
    w.body = body;
    w.grid = grid;
    w.block = block;
    w.nthreads = static_cast<int>(threads);
    w.failed = false;
    w.error = cudaSuccess;
    w.message.clear();
    w.random = seed != 0;
    w.rng.seed(seed);
    w.collectives = 0;
    w.barriers = 0;
    gridDim = grid;
    blockDim = block;

    uint64_t const nblocks = static_cast<uint64_t>(grid.x) * grid.y * grid.z;
    std::vector<uint64_t> order(static_cast<std::size_t>(nblocks));
    for (uint64_t i = 0; i < nblocks; ++i)
    {
        order[static_cast<std::size_t>(i)] = i;
    }
    if (w.random)
    {
        for (std::size_t i = order.size(); i > 1; --i)
        {
            std::swap(order[i - 1], order[static_cast<std::size_t>(w.rng() % i)]);
        }
    }
    uint64_t blocksRun = 0;
    for (uint64_t b : order)
    {
        blockIdx = uint3{static_cast<unsigned>(b % grid.x), static_cast<unsigned>((b / grid.x) % grid.y),
            static_cast<unsigned>(b / (static_cast<uint64_t>(grid.x) * grid.y))};
        ++blocksRun;
        if (!runBlock(w))
        {
            break;
        }
    }
    w.inLaunch = false;
    w.current = nullptr;
    threadIdx = uint3{0, 0, 0};

    rec.status = static_cast<int>(w.error);
    rec.error = w.message;
    rec.blocksRun = blocksRun;
    rec.collectives = w.collectives;
    rec.barriers = w.barriers;
    {
        std::lock_guard<std::mutex> lock(G().mu);
        recordLocked(std::move(rec));
        if (w.failed)
        {
            G().lastMessage = w.message;
        }
    }
    return w.failed ? setLastError(w.error) : cudaSuccess;
}

} // namespace detail
} // namespace simt
