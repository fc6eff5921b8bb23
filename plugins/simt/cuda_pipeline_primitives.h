// qkrope SIMT emulation: stand-in for CUDA's cuda_pipeline_primitives.h (asynchronous copies global
// -> shared, cp.async). The semantics are the emulator's (simt.h): copies land in shared memory
// only when __pipeline_wait_prior retires their group.
#pragma once

#include "cuda_runtime.h"

inline void __pipeline_memcpy_async(void* dst_shared, void const* src_global, std::size_t size_and_align,
    std::size_t zfill = 0, simt::detail::Loc loc = SIMT_HERE)
{
    simt::detail::asyncCopy(dst_shared, src_global, size_and_align, zfill, loc);
}

inline void __pipeline_commit(simt::detail::Loc loc = SIMT_HERE)
{
    simt::detail::asyncCommit(loc);
}

inline void __pipeline_wait_prior(std::size_t prior, simt::detail::Loc loc = SIMT_HERE)
{
    simt::detail::asyncWaitPrior(prior, loc);
}
