// qkrope: the CPU build of the kernel arithmetic (libqkrope_kernel_host.so). It runs the same
// __host__ __device__ functions as the CUDA kernel (qknorm_rope_math.h), one row at a time, so
// the tests can check the kernel's maths against the PyTorch reference on a machine without a
// GPU. The sum of squares follows the order of the kernel path the launcher would take for the
// same arguments (qknorm_rope_plan.h), so this build and the kernel agree bit for bit. Built by a
// plain C++ compiler with -ffp-contract=off (no FMA contraction, as on the device where the
// header uses __fmul_rn/__fadd_rn). Only the qkrope_host_* functions are exported.
#include "qknorm_rope.h"
#include "qknorm_rope_capi.h"
#include "qknorm_rope_math.h"
#include "qknorm_rope_plan.h"

#include <vector>

namespace
{

// A weight tensor of n elements as fp32 values: converted from the activation type, or read as
// float32 (p.weightsFp32). Each value is exact either way; the kernel converts the same way.
template <typename T>
std::vector<float> weightsAsFloat(qkrope::QKNormRoPEParams const& p, void const* w, int64_t n)
{
    std::vector<float> out(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i)
    {
        out[static_cast<size_t>(i)] = p.weightsFp32 ? static_cast<float const*>(w)[i]
                                                    : T::toFloat(static_cast<typename T::Storage const*>(w)[i]);
    }
    return out;
}

template <typename T>
void runRows(qkrope::QKNormRoPEParams const& p)
{
    using Storage = typename T::Storage;
    float scratch[qkrope::kMAX_HEAD_DIM];
    int64_t const weightElems = p.normScope == qkrope::kNORM_SCOPE_ROW ? p.numHeads * p.headDim : p.headDim;
    std::vector<float> const weights[2] = {
        weightsAsFloat<T>(p, p.qWeight, weightElems), weightsAsFloat<T>(p, p.kWeight, weightElems)};
    int64_t const tokens = p.batch * p.seqLen;
    int const headDim = static_cast<int>(p.headDim);
    int const rotaryDim = static_cast<int>(p.rotaryDim);
    qkrope::SumLayout const layout = qkrope::sumLayout(p);
    for (int64_t t = 0; t < tokens; ++t)
    {
        float const* cacheRow = p.cache + (t % p.seqLen) * p.rotaryDim;
        for (int which = 0; which < 2; ++which)
        {
            Storage const* src = static_cast<Storage const*>(which == 0 ? p.q : p.k);
            Storage* dst = static_cast<Storage*>(which == 0 ? p.qOut : p.kOut);
            float const* w = weights[which].data();
            if (p.normScope == qkrope::kNORM_SCOPE_ROW)
            {
                // one RMS over the token's heads x head_dim values, one weight per value
                int64_t const offset = t * p.numHeads * p.headDim;
                float const inv = qkrope::math::rmsInv(
                    qkrope::math::rowSumSquares<T>(src + offset, p.numHeads, headDim, layout.lanes, layout.vec),
                    static_cast<int>(p.numHeads * p.headDim), p.eps);
                for (int64_t h = 0; h < p.numHeads; ++h)
                {
                    int64_t const at = offset + h * p.headDim;
                    qkrope::math::normRopeRowInv<T>(src + at, w + h * p.headDim, cacheRow, dst + at, headDim,
                        rotaryDim, inv, p.interleaved, p.rounding, scratch);
                }
                continue;
            }
            for (int64_t h = 0; h < p.numHeads; ++h)
            {
                int64_t const offset = (t * p.numHeads + h) * p.headDim;
                qkrope::math::normRopeRow<T>(src + offset, w, cacheRow, dst + offset, headDim, rotaryDim, p.eps,
                    p.interleaved, p.rounding, layout.lanes, layout.vec, scratch);
            }
        }
    }
}

} // namespace

extern "C" int32_t qkrope_host_run_v3(void const* q, void const* k, void const* q_weight, void const* k_weight,
    float const* cache, void* q_out, void* k_out, int64_t batch, int64_t seq_len, int64_t num_heads, int64_t head_dim,
    int64_t rotary_dim, int64_t cache_rows, float eps, int32_t interleaved, int32_t rounding, int32_t norm_scope,
    int32_t dtype, int32_t weight_dtype)
{
    qkrope::QKNormRoPEParams p;
    qkrope::Status bad = qkrope::paramsFromCAbi(q, k, q_weight, k_weight, cache, q_out, k_out, batch, seq_len,
        num_heads, head_dim, rotary_dim, cache_rows, eps, interleaved, rounding, dtype, p);
    if (bad == qkrope::Status::kSUCCESS)
    {
        bad = qkrope::weightsFromCAbi(dtype, weight_dtype, p);
    }
    if (bad != qkrope::Status::kSUCCESS)
    {
        return static_cast<int32_t>(bad);
    }
    p.normScope = norm_scope;
    qkrope::Status const s = qkrope::checkParams(p);
    if (s != qkrope::Status::kSUCCESS)
    {
        return static_cast<int32_t>(s);
    }
    if (batch == 0 || seq_len == 0 || num_heads == 0)
    {
        return 0;
    }
    switch (p.dtype)
    {
    case qkrope::DataType::kFLOAT32: runRows<qkrope::math::Fp32>(p); break;
    case qkrope::DataType::kFLOAT16: runRows<qkrope::math::Fp16>(p); break;
    case qkrope::DataType::kBFLOAT16: runRows<qkrope::math::Bf16>(p); break;
    }
    return 0;
}

extern "C" int32_t qkrope_host_run_scoped(void const* q, void const* k, void const* q_weight, void const* k_weight,
    float const* cache, void* q_out, void* k_out, int64_t batch, int64_t seq_len, int64_t num_heads, int64_t head_dim,
    int64_t rotary_dim, int64_t cache_rows, float eps, int32_t interleaved, int32_t rounding, int32_t norm_scope,
    int32_t dtype)
{
    return qkrope_host_run_v3(q, k, q_weight, k_weight, cache, q_out, k_out, batch, seq_len, num_heads, head_dim,
        rotary_dim, cache_rows, eps, interleaved, rounding, norm_scope, dtype, dtype);
}

extern "C" int32_t qkrope_host_run(void const* q, void const* k, void const* q_weight, void const* k_weight,
    float const* cache, void* q_out, void* k_out, int64_t batch, int64_t seq_len, int64_t num_heads, int64_t head_dim,
    int64_t rotary_dim, int64_t cache_rows, float eps, int32_t interleaved, int32_t rounding, int32_t dtype)
{
    return qkrope_host_run_scoped(q, k, q_weight, k_weight, cache, q_out, k_out, batch, seq_len, num_heads, head_dim,
        rotary_dim, cache_rows, eps, interleaved, rounding, qkrope::kNORM_SCOPE_HEAD, dtype);
}

extern "C" char const* qkrope_host_status_string(int32_t status)
{
    return qkrope::statusString(static_cast<qkrope::Status>(status));
}

extern "C" int32_t qkrope_host_capi_version(void)
{
    return QKROPE_CAPI_VERSION;
}
