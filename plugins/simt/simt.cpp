// qkrope SIMT emulation: the scheduler, the collectives, the runtime API and the C control API
// (qkrope_simt_*). What is emulated and what is not: see simt.h.
//
// Execution: a launch runs its blocks one after another on the calling OS thread. For each block
// every CUDA thread becomes a fiber (ucontext; stacks from one mmap'ed region per OS thread, a
// PROT_NONE guard page below each). A fiber runs until it reaches a sync point (a warp collective
// or __syncthreads) that cannot complete yet, or exits; the scheduler then resumes another ready
// fiber (FIFO = round-robin, or a seeded random pick). The last lane to arrive at a collective
// computes every participant's result and makes them ready. When no fiber is ready and some have
// not exited, the block is deadlocked: that (and every other misuse the collectives detect) ends
// the launch with an error and a message; the abandoned fibers are never resumed.
#include "cuda_runtime.h"

#include <cxxabi.h>
#include <dlfcn.h>
#include <elf.h>
#include <sys/mman.h>
#include <ucontext.h>
#include <unistd.h>

#include <cinttypes>
#include <cstdio>
#include <deque>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <sstream>

thread_local uint3 threadIdx;
thread_local uint3 blockIdx;
thread_local dim3 blockDim;
thread_local dim3 gridDim;

#define SIMT_EXPORT extern "C" __attribute__((visibility("default")))

namespace simt
{
namespace
{

constexpr int kMaxDevices = 64;
constexpr std::size_t kMaxRecords = 100000;

struct LaunchRecord
{
    uint64_t seq;
    std::string kernel;
    dim3 grid;
    dim3 block;
    std::size_t smem;
    int device;
    DeviceConfig config;
    uint64_t seed;
    int status;
    std::string error;
    uint64_t blocksRun;
    uint64_t collectives;
    uint64_t barriers;
};

struct Global
{
    std::mutex mu;
    std::vector<DeviceConfig> devices{DeviceConfig{}};
    int current = 0;
    uint64_t seed = 0;
    std::size_t stackSize = 64 * 1024;
    bool dryRun = false; // record launches without running them (to probe the launcher's choices)
    bool strictExit = false;
    std::string lastMessage;
    std::deque<LaunchRecord> records;
    uint64_t seq = 0;
    std::map<std::string, std::map<uintptr_t, std::string>> symtabs; // file -> offset -> mangled
    std::map<void const*, std::string> names;
    std::map<void const*, uint64_t> occupancyQueries;
};

Global& G()
{
    static Global* g = new Global; // never destroyed: usable from other static destructors
    return *g;
}

// Append a launch to the record log (numbered, the oldest dropped past kMaxRecords); G().mu held.
void recordLocked(LaunchRecord rec)
{
    rec.seq = ++G().seq;
    if (G().records.size() >= kMaxRecords)
    {
        G().records.pop_front();
    }
    G().records.push_back(std::move(rec));
}

thread_local cudaError_t tlLastError = cudaSuccess;

// ---- kernel names from the symbol table -------------------------------------------------------------
std::string demangle(char const* mangled)
{
    int status = 0;
    char* d = abi::__cxa_demangle(mangled, nullptr, nullptr, &status);
    std::string out = (status == 0 && d != nullptr) ? std::string(d) : std::string(mangled);
    std::free(d);
    return out;
}

// All FUNC symbols of an ELF file's .symtab (the static table: hidden and local functions too).
std::map<uintptr_t, std::string> const& symtabOf(std::string const& file)
{
    auto it = G().symtabs.find(file);
    if (it != G().symtabs.end())
    {
        return it->second;
    }
    std::map<uintptr_t, std::string>& out = G().symtabs[file];
    std::ifstream in(file, std::ios::binary);
    std::vector<char> data((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (data.size() < sizeof(Elf64_Ehdr) || std::memcmp(data.data(), ELFMAG, SELFMAG) != 0
        || data[EI_CLASS] != ELFCLASS64)
    {
        return out;
    }
    Elf64_Ehdr eh;
    std::memcpy(&eh, data.data(), sizeof(eh));
    if (eh.e_shoff == 0 || eh.e_shentsize != sizeof(Elf64_Shdr)
        || eh.e_shoff + static_cast<uint64_t>(eh.e_shnum) * sizeof(Elf64_Shdr) > data.size())
    {
        return out;
    }
    std::vector<Elf64_Shdr> sh(eh.e_shnum);
    std::memcpy(sh.data(), data.data() + eh.e_shoff, eh.e_shnum * sizeof(Elf64_Shdr));
    for (Elf64_Shdr const& s : sh)
    {
        if ((s.sh_type != SHT_SYMTAB && s.sh_type != SHT_DYNSYM) || s.sh_link >= sh.size()
            || s.sh_offset + s.sh_size > data.size())
        {
            continue;
        }
        Elf64_Shdr const& strs = sh[s.sh_link];
        if (strs.sh_offset + strs.sh_size > data.size())
        {
            continue;
        }
        std::size_t const n = s.sh_size / sizeof(Elf64_Sym);
        for (std::size_t i = 0; i < n; ++i)
        {
            Elf64_Sym sym;
            std::memcpy(&sym, data.data() + s.sh_offset + i * sizeof(Elf64_Sym), sizeof(sym));
            if (ELF64_ST_TYPE(sym.st_info) != STT_FUNC || sym.st_value == 0 || sym.st_name >= strs.sh_size)
            {
                continue;
            }
            char const* name = data.data() + strs.sh_offset + sym.st_name;
            std::string& slot = out[sym.st_value];
            if (slot.empty() || std::strchr(slot.c_str(), '.') != nullptr) // prefer names without clone suffixes
            {
                slot = name;
            }
        }
    }
    return out;
}

// Caller holds G().mu.
std::string const& kernelName(void const* kernel, char const* signature)
{
    auto it = G().names.find(kernel);
    if (it != G().names.end())
    {
        return it->second;
    }
    std::string name;
    Dl_info info{};
    if (dladdr(kernel, &info) != 0)
    {
        if (info.dli_sname != nullptr && info.dli_saddr == kernel)
        {
            name = demangle(info.dli_sname);
        }
        else if (info.dli_fname != nullptr)
        {
            auto const& tab = symtabOf(info.dli_fname);
            uintptr_t const off = reinterpret_cast<uintptr_t>(kernel) - reinterpret_cast<uintptr_t>(info.dli_fbase);
            auto s = tab.find(off);
            if (s != tab.end())
            {
                name = demangle(s->second.c_str());
            }
        }
    }
    if (name.empty())
    {
        char buf[64];
        std::snprintf(buf, sizeof(buf), "kernel@%p ", kernel);
        name = std::string(buf) + demangle(signature);
    }
    return G().names[kernel] = name;
}

std::string jsonString(std::string const& s)
{
    std::string out = "\"";
    for (char c : s)
    {
        switch (c)
        {
        case '"': out += "\\\""; break;
        case '\\': out += "\\\\"; break;
        case '\n': out += "\\n"; break;
        case '\t': out += "\\t"; break;
        default:
            if (static_cast<unsigned char>(c) < 0x20)
            {
                char buf[8];
                std::snprintf(buf, sizeof(buf), "\\u%04x", c);
                out += buf;
            }
            else
            {
                out += c;
            }
        }
    }
    return out + "\"";
}

char const* baseName(char const* path)
{
    char const* s = std::strrchr(path != nullptr ? path : "?", '/');
    return s != nullptr ? s + 1 : (path != nullptr ? path : "?");
}

char const* opName(detail::Op op)
{
    using detail::Op;
    switch (op)
    {
    case Op::SyncWarp: return "__syncwarp";
    case Op::ShflIdx: return "__shfl_sync";
    case Op::ShflUp: return "__shfl_up_sync";
    case Op::ShflDown: return "__shfl_down_sync";
    case Op::ShflXor: return "__shfl_xor_sync";
    case Op::Ballot: return "__ballot_sync";
    case Op::Any: return "__any_sync";
    case Op::All: return "__all_sync";
    case Op::MatchAny: return "__match_any_sync";
    case Op::MatchAll: return "__match_all_sync";
    case Op::ReduceAddU:
    case Op::ReduceAddS: return "__reduce_add_sync";
    case Op::ReduceMinU:
    case Op::ReduceMinS: return "__reduce_min_sync";
    case Op::ReduceMaxU:
    case Op::ReduceMaxS: return "__reduce_max_sync";
    case Op::ReduceAnd: return "__reduce_and_sync";
    case Op::ReduceOr: return "__reduce_or_sync";
    case Op::ReduceXor: return "__reduce_xor_sync";
    }
    return "?";
}

bool isShuffle(detail::Op op)
{
    using detail::Op;
    return op == Op::ShflIdx || op == Op::ShflUp || op == Op::ShflDown || op == Op::ShflXor;
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

// ---- per-OS-thread execution state ------------------------------------------------------------------
enum class FState : uint8_t
{
    Ready,
    Running,
    WaitWarp,
    WaitBlock,
    Exited
};

struct Fiber
{
    ucontext_t ctx;
    FState state;
    int tid;
    int warp;
    int lane;
    uint3 idx;
    uint64_t result;
    int pred;
    detail::Op waitOp;
    unsigned waitMask;
    detail::Loc waitLoc;
};

struct Pending
{
    detail::Op op;
    unsigned mask;
    int width;
    int size;
    unsigned arrived;
    detail::Loc loc;
    uint64_t value[32];
    int arg[32];
};

struct WarpState
{
    std::vector<Pending> pending;
    unsigned existing = 0;
    unsigned exited = 0;
};

struct Worker
{
    // stacks
    char* region = nullptr;
    std::size_t regionBytes = 0;
    std::size_t stackBytes = 0;
    int capacity = 0;
    std::vector<Fiber> fibers;
    ucontext_t sched;
    Fiber* current = nullptr;
    bool inLaunch = false;

    // the launch
    detail::Body body{};
    std::string kernel;
    dim3 grid, block;
    int nthreads = 0;
    std::vector<WarpState> warps;
    int barrierCount = 0;
    detail::Loc barrierLoc{};
    int exitedCount = 0;
    bool failed = false;
    cudaError_t error = cudaSuccess;
    std::string message;
    bool random = false;
    bool strictExit = false; // also report masks naming exited / non-existent lanes
    std::mt19937_64 rng;
    std::deque<int> readyFifo;
    std::vector<int> readyPool;
    uint64_t collectives = 0;
    uint64_t barriers = 0;

    ~Worker()
    {
        if (region != nullptr)
        {
            munmap(region, regionBytes);
        }
    }
};

thread_local Worker tlWorker;

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

std::string blockText(Worker const& w)
{
    char buf[160];
    std::snprintf(buf, sizeof(buf), "block (%u,%u,%u) of grid (%u,%u,%u), block dim (%u,%u,%u)", blockIdx.x,
        blockIdx.y, blockIdx.z, w.grid.x, w.grid.y, w.grid.z, w.block.x, w.block.y, w.block.z);
    return buf;
}

// Ends the running fiber's launch with an error (from inside a fiber: never returns).
[[noreturn]] void failFiber(Worker& w, cudaError_t code, std::string const& what)
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
    using detail::Op;
    // The participants: the lanes of the mask that arrived (lanes of the mask that exited, or do
    // not exist, take no part: CUDA requires only the non-exited threads named in the mask).
    unsigned const mask = p.arrived;
    unsigned const exited = p.mask & ~p.arrived;
    uint64_t results[32] = {};
    int preds[32] = {};
    switch (p.op)
    {
    case Op::SyncWarp: break;
    case Op::ShflIdx:
    case Op::ShflUp:
    case Op::ShflDown:
    case Op::ShflXor:
    {
        // PTX shfl.sync with c = ((32 - width) << 8) | clamp (clamp 0 for up, 0x1f otherwise).
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
        break;
    }
    case Op::Ballot:
    case Op::Any:
    case Op::All:
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
        break;
    }
    case Op::MatchAny:
    case Op::MatchAll:
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
        break;
    }
    default:
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
            switch (p.op)
            {
            case Op::ReduceAddU:
            case Op::ReduceAddS: acc += v; break;
            case Op::ReduceMinU: acc = v < acc ? v : acc; break;
            case Op::ReduceMaxU: acc = v > acc ? v : acc; break;
            case Op::ReduceMinS: acc = static_cast<int32_t>(v) < static_cast<int32_t>(acc) ? v : acc; break;
            case Op::ReduceMaxS: acc = static_cast<int32_t>(v) > static_cast<int32_t>(acc) ? v : acc; break;
            case Op::ReduceAnd: acc &= v; break;
            case Op::ReduceOr: acc |= v; break;
            default: acc ^= v; break;
            }
        }
        for (int i = 0; i < 32; ++i)
        {
            results[i] = acc;
        }
        break;
    }
    }
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

DeviceConfig configOf(int device)
{
    Global& g = G();
    return device >= 0 && device < static_cast<int>(g.devices.size()) ? g.devices[static_cast<std::size_t>(device)]
                                                                       : DeviceConfig{};
}

} // namespace

// ---- collectives ------------------------------------------------------------------------------------------
namespace detail
{

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

// ---- configuration ------------------------------------------------------------------------------------
int configure(DeviceConfig const& cfg, uint64_t seed)
{
    if (cfg.numSms < 1 || cfg.numSms > 1024 || cfg.blocksPerSm < 1 || cfg.blocksPerSm > 64 || cfg.maxThreadsPerSm < 32)
    {
        return -1;
    }
    std::lock_guard<std::mutex> lock(G().mu);
    Global& g = G();
    int id = -1;
    for (std::size_t i = 0; i < g.devices.size(); ++i)
    {
        if (g.devices[i] == cfg)
        {
            id = static_cast<int>(i);
        }
    }
    if (id < 0)
    {
        if (static_cast<int>(g.devices.size()) >= kMaxDevices)
        {
            return -1;
        }
        g.devices.push_back(cfg);
        id = static_cast<int>(g.devices.size()) - 1;
    }
    g.current = id;
    g.seed = seed;
    return id;
}

DeviceConfig currentConfig()
{
    std::lock_guard<std::mutex> lock(G().mu);
    return configOf(G().current);
}

uint64_t currentSeed()
{
    std::lock_guard<std::mutex> lock(G().mu);
    return G().seed;
}

void setStackSize(std::size_t bytes)
{
    std::lock_guard<std::mutex> lock(G().mu);
    G().stackSize = bytes;
}

char const* lastErrorMessage()
{
    thread_local std::string copy;
    std::lock_guard<std::mutex> lock(G().mu);
    copy = G().lastMessage;
    return copy.c_str();
}

void clearStats()
{
    std::lock_guard<std::mutex> lock(G().mu);
    G().records.clear();
    G().lastMessage.clear();
    G().occupancyQueries.clear();
}

} // namespace simt

// ---- runtime API ------------------------------------------------------------------------------------------
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
    cudaError_t const e = simt::tlLastError;
    simt::tlLastError = cudaSuccess;
    return e;
}

cudaError_t cudaPeekAtLastError()
{
    return simt::tlLastError;
}

cudaError_t cudaGetDevice(int* device)
{
    if (device == nullptr)
    {
        return simt::detail::setLastError(cudaErrorInvalidValue);
    }
    std::lock_guard<std::mutex> lock(simt::G().mu);
    *device = simt::G().current;
    return cudaSuccess;
}

cudaError_t cudaSetDevice(int device)
{
    std::lock_guard<std::mutex> lock(simt::G().mu);
    if (device < 0 || device >= static_cast<int>(simt::G().devices.size()))
    {
        return simt::detail::setLastError(cudaErrorInvalidDevice);
    }
    simt::G().current = device;
    return cudaSuccess;
}

cudaError_t cudaGetDeviceCount(int* count)
{
    if (count == nullptr)
    {
        return simt::detail::setLastError(cudaErrorInvalidValue);
    }
    std::lock_guard<std::mutex> lock(simt::G().mu);
    *count = static_cast<int>(simt::G().devices.size());
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
        std::lock_guard<std::mutex> lock(simt::G().mu);
        if (device < 0 || device >= static_cast<int>(simt::G().devices.size()))
        {
            return simt::detail::setLastError(cudaErrorInvalidDevice);
        }
        cfg = simt::G().devices[static_cast<std::size_t>(device)];
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
        std::lock_guard<std::mutex> lock(simt::G().mu);
        cfg = simt::G().devices[static_cast<std::size_t>(device)];
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

// ---- C control API ------------------------------------------------------------------------------------------
namespace
{
std::string configJson()
{
    simt::DeviceConfig const c = simt::currentConfig();
    int device = 0;
    (void) cudaGetDevice(&device);
    std::size_t stack;
    {
        std::lock_guard<std::mutex> lock(simt::G().mu);
        stack = simt::G().stackSize;
    }
    bool dry;
    {
        std::lock_guard<std::mutex> lock(simt::G().mu);
        dry = simt::G().dryRun;
    }
    char buf[256];
    std::snprintf(buf, sizeof(buf),
        "{\"device\": %d, \"num_sms\": %d, \"blocks_per_sm\": %d, \"max_threads_per_sm\": %d, \"seed\": %" PRIu64
        ", \"stack_bytes\": %zu, \"dry_run\": %s}",
        device, c.numSms, c.blocksPerSm, c.maxThreadsPerSm, simt::currentSeed(), stack, dry ? "true" : "false");
    return buf;
}
} // namespace

// Selects the emulated device: num_sms / blocks_per_sm < 0 keep the current value; seed < 0 keeps
// the current seed (0 = round-robin order, else seeded random order). Returns the device id or -1.
SIMT_EXPORT int32_t qkrope_simt_configure(int32_t num_sms, int32_t blocks_per_sm, int64_t seed)
{
    simt::DeviceConfig cfg = simt::currentConfig();
    if (num_sms >= 0)
    {
        cfg.numSms = num_sms;
    }
    if (blocks_per_sm >= 0)
    {
        cfg.blocksPerSm = blocks_per_sm;
    }
    uint64_t const s = seed >= 0 ? static_cast<uint64_t>(seed) : simt::currentSeed();
    return simt::configure(cfg, s);
}

// Selects a modelled device: its SM count, threads per SM, compute capability, SM and memory
// clocks (kHz) and bus width (what cudaDeviceGetAttribute answers), and the resident blocks per
// SM of named kernels (`occupancy`: lines "demangled kernel name<TAB>blocks", or NULL for none;
// other kernels keep the current blocks_per_sm). seed < 0 keeps the current seed. Returns the
// device id, or -1 for a value out of range or a malformed occupancy line.
SIMT_EXPORT int32_t qkrope_simt_configure_model(int32_t num_sms, int32_t max_threads_per_sm, int32_t cc_major,
    int32_t cc_minor, int32_t clock_khz, int32_t mem_clock_khz, int32_t bus_width_bits, char const* occupancy,
    int64_t seed)
{
    simt::DeviceConfig cfg = simt::currentConfig();
    if (cc_major < 1 || cc_minor < 0 || clock_khz <= 0 || mem_clock_khz <= 0 || bus_width_bits <= 0)
    {
        return -1;
    }
    cfg.numSms = num_sms;
    cfg.maxThreadsPerSm = max_threads_per_sm;
    cfg.ccMajor = cc_major;
    cfg.ccMinor = cc_minor;
    cfg.clockKHz = clock_khz;
    cfg.memClockKHz = mem_clock_khz;
    cfg.busWidthBits = bus_width_bits;
    cfg.occupancy.clear();
    for (char const* line = occupancy; line != nullptr && *line != '\0';)
    {
        char const* const end = std::strchr(line, '\n');
        std::string const text(line, end != nullptr ? static_cast<std::size_t>(end - line) : std::strlen(line));
        line = end != nullptr ? end + 1 : nullptr;
        if (text.empty())
        {
            continue;
        }
        std::size_t const tab = text.rfind('\t');
        if (tab == std::string::npos || tab == 0)
        {
            return -1;
        }
        char* stop = nullptr;
        long const blocks = std::strtol(text.c_str() + tab + 1, &stop, 10);
        if (stop == text.c_str() + tab + 1 || *stop != '\0' || blocks < 0 || blocks > 64)
        {
            return -1;
        }
        cfg.occupancy[text.substr(0, tab)] = static_cast<int>(blocks);
    }
    uint64_t const s = seed >= 0 ? static_cast<uint64_t>(seed) : simt::currentSeed();
    return simt::configure(cfg, s);
}

SIMT_EXPORT char const* qkrope_simt_config_json(void)
{
    thread_local std::string out;
    out = configJson();
    return out.c_str();
}

SIMT_EXPORT int32_t qkrope_simt_set_stack_size(int64_t bytes)
{
    if (bytes < 16 * 1024 || bytes > (int64_t{1} << 26))
    {
        return -1;
    }
    simt::setStackSize(static_cast<std::size_t>(bytes));
    return 0;
}

SIMT_EXPORT char const* qkrope_simt_last_error(void)
{
    return simt::lastErrorMessage();
}

// The calling thread's pending CUDA error (cudaPeekAtLastError), and a way to plant one: tests use
// it to check that a launch reports its own status and leaves an earlier error for its owner.
SIMT_EXPORT int32_t qkrope_simt_peek_error(void)
{
    return static_cast<int32_t>(cudaPeekAtLastError());
}

SIMT_EXPORT void qkrope_simt_set_pending_error(int32_t error)
{
    simt::detail::setLastError(static_cast<cudaError_t>(error));
}

SIMT_EXPORT void qkrope_simt_reset(void)
{
    simt::clearStats();
    (void) cudaGetLastError();
}

SIMT_EXPORT int64_t qkrope_simt_launch_count(void)
{
    std::lock_guard<std::mutex> lock(simt::G().mu);
    return static_cast<int64_t>(simt::G().records.size());
}

// The launches recorded since the last reset, oldest first, as a JSON array.
SIMT_EXPORT char const* qkrope_simt_launches_json(void)
{
    thread_local std::string out;
    std::ostringstream s;
    std::lock_guard<std::mutex> lock(simt::G().mu);
    s << "[";
    bool first = true;
    for (auto const& r : simt::G().records)
    {
        s << (first ? "" : ",\n") << "{\"seq\": " << r.seq << ", \"kernel\": " << simt::jsonString(r.kernel)
          << ", \"grid\": [" << r.grid.x << ", " << r.grid.y << ", " << r.grid.z << "], \"block\": [" << r.block.x
          << ", " << r.block.y << ", " << r.block.z << "], \"smem\": " << r.smem << ", \"device\": " << r.device
          << ", \"num_sms\": " << r.config.numSms << ", \"blocks_per_sm\": " << r.config.blocksPerSm
          << ", \"seed\": " << r.seed << ", \"status\": " << r.status << ", \"error\": " << simt::jsonString(r.error)
          << ", \"blocks_run\": " << r.blocksRun << ", \"collectives\": " << r.collectives
          << ", \"barriers\": " << r.barriers << "}";
        first = false;
    }
    s << "]";
    out = s.str();
    return out.c_str();
}

// Demangled names of the function symbols of this library whose name contains `substring`
// (the template instances that exist in the binary), as a JSON array.
SIMT_EXPORT char const* qkrope_simt_symbols_json(char const* substring)
{
    thread_local std::string out;
    std::string const needle = substring != nullptr ? substring : "";
    Dl_info info{};
    std::ostringstream s;
    s << "[";
    if (dladdr(reinterpret_cast<void const*>(&qkrope_simt_symbols_json), &info) != 0 && info.dli_fname != nullptr)
    {
        std::lock_guard<std::mutex> lock(simt::G().mu);
        bool first = true;
        for (auto const& kv : simt::symtabOf(info.dli_fname))
        {
            std::string const d = simt::demangle(kv.second.c_str());
            if (d.find(needle) != std::string::npos && kv.second.find('.') == std::string::npos)
            {
                s << (first ? "" : ", ") << simt::jsonString(d);
                first = false;
            }
        }
    }
    s << "]";
    out = s.str();
    return out.c_str();
}

// 1: launches are checked and recorded but not run (outputs untouched); 0: launches run.
SIMT_EXPORT void qkrope_simt_set_dry_run(int32_t on)
{
    std::lock_guard<std::mutex> lock(simt::G().mu);
    simt::G().dryRun = on != 0;
}

// 1: a mask naming a lane that exited (or does not exist) is reported as an error, although CUDA
// requires only the non-exited lanes of a mask to take part; 0 (default): CUDA's rule, and a
// shuffle reading such a lane is the error.
SIMT_EXPORT void qkrope_simt_set_strict_exit(int32_t on)
{
    std::lock_guard<std::mutex> lock(simt::G().mu);
    simt::G().strictExit = on != 0;
}

SIMT_EXPORT int32_t qkrope_simt_version(void)
{
    return 1;
}
