// SIMT emulation, internal: what the emulator's translation units share (src/). Not installed, not
// for kernels: kernels see cuda_runtime.h and simt.h only.
//
//   simt_state.cpp        the emulated devices, the settings and the launch log (Global)
//   simt_symbols.cpp      kernel names from the ELF symbol tables
//   simt_scheduler.cpp    fibers, stacks and the per-block scheduler; simt::detail::launch
//   simt_collectives.cpp  warp collectives and __syncthreads (arrival, checks, results)
//   simt_runtime_api.cpp  the CUDA runtime API stand-ins (errors, devices, occupancy, memory)
//   simt_capi.cpp         the C control API (simt_capi.h)
#pragma once

#include "cuda_runtime.h"

#include <sys/mman.h>
#include <ucontext.h>

#include <deque>
#include <map>
#include <mutex>
#include <random>
#include <string>
#include <vector>

namespace simt
{
namespace internal
{

// ---- the emulated devices, the settings and the launch log (simt_state.cpp) -----------------------
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

// The one instance (never destroyed: usable from other static destructors).
Global& G();
// Append a launch to the record log (numbered, the oldest dropped past kMaxRecords); G().mu held.
void recordLocked(LaunchRecord rec);
// The configuration of an emulated device id (the default configuration for an unknown id); G().mu held.
DeviceConfig configOf(int device);

// ---- kernel names (simt_symbols.cpp) ----------------------------------------------------------------
std::string demangle(char const* mangled);
// All FUNC symbols of an ELF file's .symtab and .dynsym, by offset (mangled names); G().mu held.
std::map<uintptr_t, std::string> const& symtabOf(std::string const& file);
// The demangled name of a kernel function (or "kernel@<address> <signature>"); G().mu held.
std::string const& kernelName(void const* kernel, char const* signature);

// ---- message text (simt_collectives.cpp) ------------------------------------------------------------
char const* baseName(char const* path);
char const* opName(detail::Op op);
bool isShuffle(detail::Op op);
std::string laneList(unsigned bits);
std::string hex(unsigned v);
std::string where(detail::Loc loc);

// ---- per-OS-thread execution state ------------------------------------------------------------------
enum class FState : uint8_t
{
    Ready,
    Running,
    WaitWarp,
    WaitBlock,
    Exited
};

// One asynchronous copy in flight (cp.async): its destination and the source bytes read at issue.
struct AsyncCopy
{
    void* dst;
    std::size_t bytes;
    unsigned char data[16];
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
    std::vector<AsyncCopy> asyncOpen;                // copies issued since the last commit
    std::deque<std::vector<AsyncCopy>> asyncGroups;  // committed groups, oldest first
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


// The calling OS thread's scheduler state (simt_scheduler.cpp).
extern thread_local Worker tlWorker;

// ---- scheduler primitives (simt_scheduler.cpp) ------------------------------------------------------
std::string blockText(Worker const& w);
// Ends the running fiber's launch with an error (from inside a fiber: never returns).
[[noreturn]] void failFiber(Worker& w, cudaError_t code, std::string const& what);
void makeReady(Worker& w, Fiber& f);
// Switches from the running fiber back to the scheduler until the fiber is made ready again.
void suspend(Worker& w);
// Under a seeded random order: lets the scheduler pick the next fiber (the running one stays ready).
void yieldIfRandom(Worker& w);

// ---- collectives (simt_collectives.cpp) -------------------------------------------------------------
std::string describeLane(Worker const& w, int warp, int lane);
std::string describePending(Worker const& w, int warp, Pending const& p);
// Computes every participant's result of a collective that all its lanes reached (or exited
// from) and makes the waiting participants ready.
void completeCollective(Worker& w, int warpIndex, Pending& p);

} // namespace internal
} // namespace simt
