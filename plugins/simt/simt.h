// qkrope SIMT emulation: the core of a small CUDA-on-the-host emulator (plugins/simt).
//
// What it emulates
//   - A kernel launch runs every block of the grid, one block after another, on the calling OS
//     thread. Every CUDA thread of a block is a real fiber (ucontext, its own 64 KiB stack with a
//     guard page), so each thread has its own registers and control flow.
//   - Warp collectives (__shfl*_sync, __syncwarp, __ballot_sync, __any/__all_sync,
//     __match*_sync, __reduce*_sync) are real barriers: a lane waits until every lane named in
//     the mask has arrived at a matching collective, then every result is computed from the
//     values the lanes contributed (PTX shfl semantics, width included). __syncthreads is a block
//     barrier.
//   - Asynchronous copies into shared memory (cp.async through cuda_pipeline_primitives.h's
//     __pipeline_memcpy_async / __pipeline_commit / __pipeline_wait_prior) with their real
//     ordering: per thread, copies join the open group, a commit closes it, and a wait for "all
//     but the N newest groups" is the only thing that makes a copy's bytes appear in shared
//     memory (the source is read at issue). A thread that reads a stage before waiting for it reads
//     the stage's previous contents; copies never waited for never land.
//   - Errors are reported, not hung on: a lane named in a mask that waits at another
//     collective or at __syncthreads, a shuffle reading a lane that exited instead of taking part
//     (a lane that skipped the shuffle), mismatched masks / widths / intrinsics between the lanes
//     of one collective, a caller not in its own mask, a shuffle reading a lane outside the mask,
//     an invalid width, a misaligned vector load/store through the __ld*/__st* intrinsics, and
//     (safety net) a block in which no fiber can run any more. The launch then returns
//     cudaErrorLaunchFailure (cudaErrorMisalignedAddress for alignment) and a message naming the
//     kernel, block, warp, lanes, intrinsic and source line is kept (simt::lastErrorMessage,
//     simt_last_error from C, simt_capi.h).
//   - Fiber and block order: round-robin by default; a non-zero seed picks a seeded random order
//     of blocks and of runnable fibers (deterministic for a given seed).
//   - A configurable device (SM count, blocks per SM returned by the occupancy query). Each
//     distinct configuration is its own device id, because launchers cache attributes per device.
//   - Per-launch statistics (demangled kernel instance name, grid, block, status, collectives).
//
// What it does not emulate
//   - No memory model beyond program order between sync points: a fiber runs until it reaches a
//     sync point (or exits), so data races show up as wrong results only when the order of
//     fibers makes them visible (use several seeds). No timing, no caches, no coalescing.
//   - No memory checking of plain loads/stores (out-of-bounds writes are caught by the tests'
//     guard bands, not here); all memory is host memory.
//   - __shared__ is `static thread_local`: shared by the fibers of a block (they run on one OS
//     thread), distinct between launches running concurrently on different OS threads; it is not
//     cleared between blocks (real shared memory is uninitialised). No dynamic (extern) shared
//     memory. No cooperative groups, clusters, textures, <<<>>> syntax, streams or events (a
//     launch is synchronous; streams are accepted and ignored).
//   - Fibers abandoned after an error are not unwound (kernel locals must be trivially
//     destructible, as in CUDA). A lane that loops forever without reaching a sync point hangs.
//   - Stricter than the hardware where the hardware is undefined or lenient: lanes of one warp
//     must reach the collectives that name them in the same order; a shuffle reading a lane that
//     exited (or is outside the mask) is an error; __syncthreads after any thread of the block
//     exited is an error. As CUDA specifies, only the non-exited lanes named in a mask must take
//     part in a collective (lanes past the end of the block count as exited);
//     simt_set_strict_exit(1) reports any mask naming an exited lane as well.
#pragma once

#include <cstddef>
#include <map>
#include <string>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <typeinfo>
#include <utility>

// ---- the CUDA stream type, identical to cuda_runtime_api.h's (and qknorm_rope.h's) typedef ----
struct CUstream_st;
typedef struct CUstream_st* cudaStream_t;

// ---- error codes (numeric values as in driver_types.h) -----------------------------------------
enum cudaError
{
    cudaSuccess = 0,
    cudaErrorInvalidValue = 1,
    cudaErrorMemoryAllocation = 2,
    cudaErrorInitializationError = 3,
    cudaErrorInvalidConfiguration = 9,
    cudaErrorInvalidSymbol = 13,
    cudaErrorInvalidDeviceFunction = 98,
    cudaErrorNoDevice = 100,
    cudaErrorInvalidDevice = 101,
    cudaErrorInvalidResourceHandle = 400,
    cudaErrorNotReady = 600,
    cudaErrorIllegalAddress = 700,
    cudaErrorLaunchOutOfResources = 701,
    cudaErrorLaunchTimeout = 702,
    cudaErrorAssert = 710,
    cudaErrorIllegalInstruction = 715,
    cudaErrorMisalignedAddress = 716,
    cudaErrorLaunchFailure = 719,
    cudaErrorNotSupported = 801,
    cudaErrorUnknown = 999
};
typedef enum cudaError cudaError_t;

// ---- built-in vector types (alignment as in vector_types.h) ------------------------------------
#define SIMT_VEC1(T, N, A)                                                                          \
    struct __attribute__((aligned(A))) N##1                                                           \
    {                                                                                               \
        T x;                                                                                        \
    };                                                                                              \
    inline N##1 make_##N##1(T x)                                                                    \
    {                                                                                               \
        return N##1{x};                                                                             \
    }
#define SIMT_VEC2(T, N, A)                                                                          \
    struct __attribute__((aligned(A))) N##2                                                           \
    {                                                                                               \
        T x, y;                                                                                     \
    };                                                                                              \
    inline N##2 make_##N##2(T x, T y)                                                               \
    {                                                                                               \
        return N##2{x, y};                                                                          \
    }
#define SIMT_VEC3(T, N)                                                                             \
    struct N##3                                                                                     \
    {                                                                                               \
        T x, y, z;                                                                                  \
    };                                                                                              \
    inline N##3 make_##N##3(T x, T y, T z)                                                          \
    {                                                                                               \
        return N##3{x, y, z};                                                                       \
    }
#define SIMT_VEC4(T, N, A)                                                                          \
    struct __attribute__((aligned(A))) N##4                                                           \
    {                                                                                               \
        T x, y, z, w;                                                                               \
    };                                                                                              \
    inline N##4 make_##N##4(T x, T y, T z, T w)                                                     \
    {                                                                                               \
        return N##4{x, y, z, w};                                                                    \
    }
#define SIMT_VECS(T, N, A1, A2, A4)                                                                 \
    SIMT_VEC1(T, N, A1) SIMT_VEC2(T, N, A2) SIMT_VEC3(T, N) SIMT_VEC4(T, N, A4)

SIMT_VECS(signed char, char, 1, 2, 4)
SIMT_VECS(unsigned char, uchar, 1, 2, 4)
SIMT_VECS(short, short, 2, 4, 8)
SIMT_VECS(unsigned short, ushort, 2, 4, 8)
SIMT_VECS(int, int, 4, 8, 16)
SIMT_VECS(unsigned int, uint, 4, 8, 16)
SIMT_VECS(long, long, 8, 16, 16)
SIMT_VECS(unsigned long, ulong, 8, 16, 16)
SIMT_VECS(long long, longlong, 8, 16, 16)
SIMT_VECS(unsigned long long, ulonglong, 8, 16, 16)
SIMT_VECS(float, float, 4, 8, 16)
SIMT_VECS(double, double, 8, 16, 16)

#undef SIMT_VECS
#undef SIMT_VEC1
#undef SIMT_VEC2
#undef SIMT_VEC3
#undef SIMT_VEC4

struct dim3
{
    unsigned int x, y, z;
    constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1) : x(vx), y(vy), z(vz) {}
    constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
    constexpr operator uint3() const
    {
        return uint3{x, y, z};
    }
};

// ---- the built-in index variables: per OS thread, rewritten by the scheduler at every switch ----
extern thread_local uint3 threadIdx;
extern thread_local uint3 blockIdx;
extern thread_local dim3 blockDim;
extern thread_local dim3 gridDim;
constexpr int warpSize = 32;

namespace simt
{

// ---- configuration and introspection (exported to C as simt_*: simt_capi.h) ---------------------
struct DeviceConfig
{
    int numSms = 2;                      // cudaDevAttrMultiProcessorCount
    int blocksPerSm = 2;                 // what cudaOccupancyMaxActiveBlocksPerMultiprocessor returns
    int maxThreadsPerSm = 2048;          // cudaDevAttrMaxThreadsPerMultiProcessor
    int sharedMemPerSm = 228 * 1024;     // cudaDevAttrMaxSharedMemoryPerMultiprocessor
    int l2CacheBytes = 2 * 1024 * 1024;  // cudaDevAttrL2CacheSize
    // A modelled device (what the launch plan reads; defaults: an H100-class sm_90)
    int ccMajor = 9;                     // cudaDevAttrComputeCapabilityMajor / Minor
    int ccMinor = 0;
    int clockKHz = 1980000;              // cudaDevAttrClockRate
    int memClockKHz = 2619000;           // cudaDevAttrMemoryClockRate
    int busWidthBits = 5120;             // cudaDevAttrGlobalMemoryBusWidth
    // Resident blocks per SM by kernel (demangled name), e.g. from ptxas's register counts;
    // kernels not listed get blocksPerSm.
    std::map<std::string, int> occupancy;

    bool operator==(DeviceConfig const& o) const
    {
        return numSms == o.numSms && blocksPerSm == o.blocksPerSm && maxThreadsPerSm == o.maxThreadsPerSm
            && sharedMemPerSm == o.sharedMemPerSm && l2CacheBytes == o.l2CacheBytes && ccMajor == o.ccMajor
            && ccMinor == o.ccMinor && clockKHz == o.clockKHz && memClockKHz == o.memClockKHz
            && busWidthBits == o.busWidthBits && occupancy == o.occupancy;
    }
};

// Selects (creating if needed) the emulated device with this configuration and makes it current;
// returns its id, or -1 when a value is out of range. seed: 0 round-robin, else seeded random order.
int configure(DeviceConfig const& cfg, uint64_t seed);
DeviceConfig currentConfig();
uint64_t currentSeed();
void setStackSize(std::size_t bytes);
char const* lastErrorMessage();  // "" when the last failing launch left none (thread-safe copy)
void clearStats();

namespace detail
{

// Where an intrinsic was called (filled in by default arguments at the call site).
struct Loc
{
    char const* file;
    int line;
    static constexpr Loc here(char const* f = __builtin_FILE(), int l = __builtin_LINE())
    {
        return Loc{f, l};
    }
};

enum class Op : int
{
    SyncWarp,
    ShflIdx,
    ShflUp,
    ShflDown,
    ShflXor,
    Ballot,
    Any,
    All,
    MatchAny,
    MatchAll,
    ReduceAddU,
    ReduceMinU,
    ReduceMaxU,
    ReduceAddS,
    ReduceMinS,
    ReduceMaxS,
    ReduceAnd,
    ReduceOr,
    ReduceXor,
};

// A warp collective by the calling fiber: blocks until every lane of `mask` has arrived, returns
// this lane's result (*pred for __match_all_sync). `size` is the byte size of the value type.
uint64_t collective(Op op, unsigned mask, uint64_t value, int arg, int width, int size, Loc loc, int* pred = nullptr);
void syncThreads(Loc loc);
unsigned activeMask();
// Asynchronous copies global -> shared (cp.async: __pipeline_memcpy_async, __pipeline_commit,
// __pipeline_wait_prior; cuda_pipeline_primitives.h). The source is read when the copy is issued;
// the destination is written only when a wait retires the copy's group, so a read of the
// destination before its wait sees what was there before (stale data), as the hardware may.
void asyncCopy(void* dst, void const* src, std::size_t bytes, std::size_t zfill, Loc loc);
void asyncCommit(Loc loc);
void asyncWaitPrior(std::size_t groups, Loc loc);
bool inKernel();
// Reports a device-side fault in the running kernel (never returns inside a launch).
[[noreturn]] void fault(cudaError_t code, char const* what, void const* address, Loc loc);
// Checks the alignment of a vector access through an intrinsic.
inline void checkAligned(void const* p, std::size_t align, char const* what, Loc loc)
{
    if ((reinterpret_cast<uintptr_t>(p) & (align - 1)) != 0 && inKernel())
    {
        fault(cudaErrorMisalignedAddress, what, p, loc);
    }
}

// The body run by every fiber of a launch (a non-owning callable reference).
struct Body
{
    void (*call)(void*);
    void* self;
};

cudaError_t launch(void const* kernel, char const* signature, dim3 grid, dim3 block, std::size_t smem,
    cudaStream_t stream, Body body);
void noteOccupancyQuery(void const* kernel, char const* signature);

template <class F>
Body makeBody(F& f)
{
    return Body{[](void* p) { (*static_cast<F*>(p))(); }, &f};
}

template <class... P, std::size_t... I>
cudaError_t launchTyped(void (*kernel)(P...), dim3 grid, dim3 block, void** args, std::size_t smem,
    cudaStream_t stream, std::index_sequence<I...>)
{
    // Copied once at launch, as the runtime copies the parameter buffer; every CUDA thread then
    // receives its own by-value copy when the kernel is called.
    std::tuple<std::decay_t<P>...> params(*static_cast<std::decay_t<P>*>(args[I])...);
    auto run = [&params, kernel]() { kernel(std::get<I>(params)...); };
    return launch(reinterpret_cast<void const*>(kernel), typeid(kernel).name(), grid, block, smem, stream,
        makeBody(run));
}

} // namespace detail

// Launches `kernel` with arguments converted to its parameter types (the macro SIMT_LAUNCH too).
template <class... P, class... A>
cudaError_t launch(void (*kernel)(P...), dim3 grid, dim3 block, std::size_t smem, cudaStream_t stream, A&&... args)
{
    static_assert(sizeof...(P) == sizeof...(A), "one argument per kernel parameter");
    std::tuple<std::decay_t<P>...> values(std::forward<A>(args)...);
    return std::apply(
        [&](auto&... v) {
            void* argv[] = {static_cast<void*>(&v)..., nullptr};
            return detail::launchTyped(kernel, grid, block, argv, smem, stream, std::index_sequence_for<P...>{});
        },
        values);
}

} // namespace simt

#define SIMT_LAUNCH(kernel, grid, block, smem, stream, ...) ::simt::launch(kernel, grid, block, smem, stream, __VA_ARGS__)
#define SIMT_HERE ::simt::detail::Loc::here()
