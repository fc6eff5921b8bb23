// qkrope SIMT emulation: asynchronous copies global -> shared (cp.async) and their groups (simt.h).
#include "simt_internal.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace simt
{
namespace detail
{
namespace
{

internal::Fiber& currentFiber(char const* what, Loc loc)
{
    internal::Worker& w = internal::tlWorker;
    if (w.current == nullptr)
    {
        std::fprintf(stderr, "simt: %s called outside an emulated kernel launch (%s)\n", what,
            internal::where(loc).c_str());
        std::abort();
    }
    return *w.current;
}

} // namespace

void asyncCopy(void* dst, void const* src, std::size_t bytes, std::size_t zfill, Loc loc)
{
    internal::Fiber& f = currentFiber("__pipeline_memcpy_async", loc);
    if (bytes != 4 && bytes != 8 && bytes != 16)
    {
        fault(cudaErrorInvalidValue, "__pipeline_memcpy_async: size is not 4, 8 or 16 bytes", dst, loc);
    }
    if (zfill > bytes)
    {
        fault(cudaErrorInvalidValue, "__pipeline_memcpy_async: zfill larger than the size", dst, loc);
    }
    checkAligned(dst, bytes, "__pipeline_memcpy_async (shared destination)", loc);
    checkAligned(src, bytes, "__pipeline_memcpy_async (global source)", loc);
    internal::AsyncCopy c{};
    c.dst = dst;
    c.bytes = bytes;
    std::memcpy(c.data, src, bytes - zfill); // the source is read now; zfill bytes become zero
    f.asyncOpen.push_back(c);
}

void asyncCommit(Loc loc)
{
    internal::Fiber& f = currentFiber("__pipeline_commit", loc);
    f.asyncGroups.push_back(std::move(f.asyncOpen)); // an empty group is a group too (as in PTX)
    f.asyncOpen.clear();
}

void asyncWaitPrior(std::size_t groups, Loc loc)
{
    internal::Fiber& f = currentFiber("__pipeline_wait_prior", loc);
    while (f.asyncGroups.size() > groups)
    {
        for (internal::AsyncCopy const& c : f.asyncGroups.front())
        {
            std::memcpy(c.dst, c.data, c.bytes);
        }
        f.asyncGroups.pop_front();
    }
    internal::yieldIfRandom(internal::tlWorker);
}

} // namespace detail
} // namespace simt
