// qkrope: the C-ABI CUDA launcher library (libqkrope_kernels.so), for tests and benchmarks from
// Python with torch CUDA tensors, without TensorRT. Only the qkrope_* functions are exported.
#include "qknorm_rope.h"
#include "qknorm_rope_capi.h"

#include <cuda_runtime.h>

extern "C" int32_t qkrope_launch_v3(void const* q, void const* k, void const* q_weight, void const* k_weight,
    float const* cache, void* q_out, void* k_out, int64_t batch, int64_t seq_len, int64_t num_heads, int64_t head_dim,
    int64_t rotary_dim, int64_t cache_rows, float eps, int32_t interleaved, int32_t rounding, int32_t norm_scope,
    int32_t dtype, int32_t weight_dtype, void* stream)
{
    qkrope::QKNormRoPEParams p;
    qkrope::Status s = qkrope::paramsFromCAbi(q, k, q_weight, k_weight, cache, q_out, k_out, batch, seq_len,
        num_heads, head_dim, rotary_dim, cache_rows, eps, interleaved, rounding, dtype, p);
    if (s == qkrope::Status::kSUCCESS)
    {
        s = qkrope::weightsFromCAbi(dtype, weight_dtype, p);
    }
    if (s != qkrope::Status::kSUCCESS)
    {
        return static_cast<int32_t>(s);
    }
    p.normScope = norm_scope;
    return static_cast<int32_t>(qkrope::launchQKNormRoPE(p, static_cast<cudaStream_t>(stream)));
}

extern "C" int32_t qkrope_launch_scoped(void const* q, void const* k, void const* q_weight, void const* k_weight,
    float const* cache, void* q_out, void* k_out, int64_t batch, int64_t seq_len, int64_t num_heads, int64_t head_dim,
    int64_t rotary_dim, int64_t cache_rows, float eps, int32_t interleaved, int32_t rounding, int32_t norm_scope,
    int32_t dtype, void* stream)
{
    return qkrope_launch_v3(q, k, q_weight, k_weight, cache, q_out, k_out, batch, seq_len, num_heads, head_dim,
        rotary_dim, cache_rows, eps, interleaved, rounding, norm_scope, dtype, dtype, stream);
}

extern "C" int32_t qkrope_launch(void const* q, void const* k, void const* q_weight, void const* k_weight,
    float const* cache, void* q_out, void* k_out, int64_t batch, int64_t seq_len, int64_t num_heads, int64_t head_dim,
    int64_t rotary_dim, int64_t cache_rows, float eps, int32_t interleaved, int32_t rounding, int32_t dtype,
    void* stream)
{
    return qkrope_launch_scoped(q, k, q_weight, k_weight, cache, q_out, k_out, batch, seq_len, num_heads, head_dim,
        rotary_dim, cache_rows, eps, interleaved, rounding, qkrope::kNORM_SCOPE_HEAD, dtype, stream);
}

extern "C" char const* qkrope_status_string(int32_t status)
{
    return qkrope::statusString(static_cast<qkrope::Status>(status));
}

extern "C" int32_t qkrope_capi_version(void)
{
    return QKROPE_CAPI_VERSION;
}
