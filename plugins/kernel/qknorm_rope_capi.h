// qkrope: C ABI of the kernel libraries, for ctypes (runtime/kernels.py) and other languages.
//   libqkrope_kernels.so      : qkrope_launch (CUDA, device pointers, a cudaStream_t as void*)
//   libqkrope_kernel_host.so  : qkrope_host_run (the same arithmetic on the CPU, host pointers)
// Tensors are contiguous: q, k, q_out, k_out [batch, seq_len, num_heads, head_dim]; weights
// [head_dim] in the activation dtype ([num_heads * head_dim] with norm_scope 1); cache
// [cache_rows, rotary_dim] float32. The *_scoped entry points take norm_scope (0: RMSNorm per head,
// 1: over the token's heads x head_dim values); the others are norm_scope 0 (C ABI version 1's calls).
// The *_v3 entry points add weight_dtype after dtype: the weights' dtype, dtype itself or 0
// (float32 weights under any activation dtype); the others pass dtype (weights in the activations').
// dtype: 0 float32, 1 float16, 2 bfloat16 (qkrope::DataType). interleaved: 1 GPT-J pairs, 0 NeoX.
// Return value: 0 on success, otherwise a qkrope::Status code; *_status_string gives its text.
#pragma once

#include <stdint.h>

#if defined(_WIN32)
#define QKROPE_CAPI_EXPORT __declspec(dllexport)
#else
#define QKROPE_CAPI_EXPORT __attribute__((visibility("default")))
#endif

#ifdef __cplusplus
extern "C" {
#endif

#define QKROPE_CAPI_VERSION 3

QKROPE_CAPI_EXPORT int32_t qkrope_launch(void const* q, void const* k, void const* q_weight, void const* k_weight,
    float const* cache, void* q_out, void* k_out, int64_t batch, int64_t seq_len, int64_t num_heads, int64_t head_dim,
    int64_t rotary_dim, int64_t cache_rows, float eps, int32_t interleaved, int32_t rounding, int32_t dtype,
    void* stream);
QKROPE_CAPI_EXPORT int32_t qkrope_launch_scoped(void const* q, void const* k, void const* q_weight,
    void const* k_weight, float const* cache, void* q_out, void* k_out, int64_t batch, int64_t seq_len,
    int64_t num_heads, int64_t head_dim, int64_t rotary_dim, int64_t cache_rows, float eps, int32_t interleaved,
    int32_t rounding, int32_t norm_scope, int32_t dtype, void* stream);
QKROPE_CAPI_EXPORT int32_t qkrope_launch_v3(void const* q, void const* k, void const* q_weight,
    void const* k_weight, float const* cache, void* q_out, void* k_out, int64_t batch, int64_t seq_len,
    int64_t num_heads, int64_t head_dim, int64_t rotary_dim, int64_t cache_rows, float eps, int32_t interleaved,
    int32_t rounding, int32_t norm_scope, int32_t dtype, int32_t weight_dtype, void* stream);
QKROPE_CAPI_EXPORT char const* qkrope_status_string(int32_t status);
QKROPE_CAPI_EXPORT int32_t qkrope_capi_version(void);

QKROPE_CAPI_EXPORT int32_t qkrope_host_run(void const* q, void const* k, void const* q_weight, void const* k_weight,
    float const* cache, void* q_out, void* k_out, int64_t batch, int64_t seq_len, int64_t num_heads, int64_t head_dim,
    int64_t rotary_dim, int64_t cache_rows, float eps, int32_t interleaved, int32_t rounding, int32_t dtype);
QKROPE_CAPI_EXPORT int32_t qkrope_host_run_scoped(void const* q, void const* k, void const* q_weight,
    void const* k_weight, float const* cache, void* q_out, void* k_out, int64_t batch, int64_t seq_len,
    int64_t num_heads, int64_t head_dim, int64_t rotary_dim, int64_t cache_rows, float eps, int32_t interleaved,
    int32_t rounding, int32_t norm_scope, int32_t dtype);
QKROPE_CAPI_EXPORT int32_t qkrope_host_run_v3(void const* q, void const* k, void const* q_weight,
    void const* k_weight, float const* cache, void* q_out, void* k_out, int64_t batch, int64_t seq_len,
    int64_t num_heads, int64_t head_dim, int64_t rotary_dim, int64_t cache_rows, float eps, int32_t interleaved,
    int32_t rounding, int32_t norm_scope, int32_t dtype, int32_t weight_dtype);
QKROPE_CAPI_EXPORT char const* qkrope_host_status_string(int32_t status);
QKROPE_CAPI_EXPORT int32_t qkrope_host_capi_version(void);

#ifdef __cplusplus
}

#include "qknorm_rope.h"

namespace qkrope
{
// The C-ABI arguments as launch parameters; shared by both libraries so they cannot drift.
// Returns kBAD_DTYPE for a dtype code outside 0..2 (checked before the enum cast).
inline Status paramsFromCAbi(void const* q, void const* k, void const* qWeight, void const* kWeight,
    float const* cache, void* qOut, void* kOut, int64_t batch, int64_t seqLen, int64_t numHeads, int64_t headDim,
    int64_t rotaryDim, int64_t cacheRows, float eps, int32_t interleaved, int32_t rounding, int32_t dtype,
    QKNormRoPEParams& p) noexcept
{
    if (dtype < 0 || dtype > 2)
    {
        return Status::kBAD_DTYPE;
    }
    p.q = q;
    p.k = k;
    p.qWeight = qWeight;
    p.kWeight = kWeight;
    p.cache = cache;
    p.qOut = qOut;
    p.kOut = kOut;
    p.batch = batch;
    p.seqLen = seqLen;
    p.numHeads = numHeads;
    p.headDim = headDim;
    p.rotaryDim = rotaryDim;
    p.cacheRows = cacheRows;
    p.eps = eps;
    p.interleaved = interleaved != 0;
    p.rounding = rounding;
    p.dtype = static_cast<DataType>(dtype);
    return Status::kSUCCESS;
}

// The weights' dtype code of the *_v3 entry points: the activations' own (weights in q's dtype)
// or 0 (float32 weights); anything else is kBAD_DTYPE.
inline Status weightsFromCAbi(int32_t dtype, int32_t weightDtype, QKNormRoPEParams& p) noexcept
{
    if (weightDtype != dtype && weightDtype != static_cast<int32_t>(DataType::kFLOAT32))
    {
        return Status::kBAD_DTYPE;
    }
    p.weightsFp32 = weightDtype == static_cast<int32_t>(DataType::kFLOAT32);
    return Status::kSUCCESS;
}
} // namespace qkrope
#endif
