// qkrope: parameter validation and status text for the QKNormRoPE launch interface. Host-only
// (no CUDA), so it is part of the CPU library as well as of the CUDA objects.
#include "qknorm_rope.h"
#include "qknorm_rope_math.h"

#include <climits>
#include <cmath>

namespace qkrope
{

Status checkParams(QKNormRoPEParams const& p) noexcept
{
    if (p.dtype != DataType::kFLOAT32 && p.dtype != DataType::kFLOAT16 && p.dtype != DataType::kBFLOAT16)
    {
        return Status::kBAD_DTYPE;
    }
    if (p.batch < 0 || p.seqLen < 0 || p.numHeads < 0 || p.cacheRows < 0)
    {
        return Status::kBAD_SHAPE;
    }
    if (p.headDim <= 0 || p.headDim % 2 != 0 || p.headDim > kMAX_HEAD_DIM)
    {
        return Status::kBAD_SHAPE;
    }
    // Sizes whose products overflow: the element counts of q/k and the cache must fit int64, and
    // one token's heads * head_dim elements int32 (the kernels index within a token with int32).
    int64_t elements = 0;
    int64_t cacheElements = 0;
    if (__builtin_mul_overflow(p.batch, p.seqLen, &elements) || __builtin_mul_overflow(elements, p.numHeads, &elements)
        || __builtin_mul_overflow(elements, p.headDim, &elements) || p.numHeads > INT32_MAX / p.headDim
        || __builtin_mul_overflow(p.cacheRows, p.rotaryDim, &cacheElements))
    {
        return Status::kBAD_SHAPE;
    }
    if (p.rotaryDim <= 0 || p.rotaryDim % 2 != 0 || p.rotaryDim > p.headDim)
    {
        return Status::kBAD_ROTARY_DIM;
    }
    if (p.cacheRows < p.seqLen)
    {
        return Status::kCACHE_OVERFLOW;
    }
    // The contract's one epsilon rule (qkrope/contract.py, epsilon_error): finite, 0 < eps < 1 as a
    // float32; rounding one of its ROUNDING_MODES (0, 1, 2). The plugin's field table (kFIELDS in
    // plugins/plugin/qknorm_rope_fields.h) says the same.
    if (!std::isfinite(p.eps) || !(p.eps > 0.0F) || !(p.eps < 1.0F) || p.rounding < 0 || p.rounding >= math::kRoundingModes
        || (p.normScope != kNORM_SCOPE_HEAD && p.normScope != kNORM_SCOPE_ROW))
    {
        return Status::kBAD_ATTRIBUTE;
    }
    bool const empty = p.batch == 0 || p.seqLen == 0 || p.numHeads == 0;
    if (!empty
        && (p.q == nullptr || p.k == nullptr || p.qWeight == nullptr || p.kWeight == nullptr || p.cache == nullptr
            || p.qOut == nullptr || p.kOut == nullptr))
    {
        return Status::kNULL_POINTER;
    }
    return Status::kSUCCESS;
}

char const* statusString(Status s) noexcept
{
    switch (s)
    {
    case Status::kSUCCESS: return "success";
    case Status::kNULL_POINTER: return "a required pointer (q, k, weights, cache or outputs) is null";
    case Status::kBAD_SHAPE:
        return "bad shape: batch, seq_len and num_heads must be >= 0, head_dim even and in [2, 512], "
               "batch * seq_len * num_heads * head_dim within int64 and num_heads * head_dim < 2^31";
    case Status::kBAD_ROTARY_DIM:
        return "bad rotary_dim (cos_sin_cache width): must be even, > 0 and <= head_dim";
    case Status::kCACHE_OVERFLOW:
        return "cos_sin_cache overflow: the cache has fewer rows than the sequence has tokens";
    case Status::kBAD_DTYPE: return "bad dtype: q/k/weights must be float32, float16 or bfloat16";
    case Status::kBAD_ATTRIBUTE: return "bad attribute: epsilon must be finite with 0 < epsilon < 1, rounding 0, 1 or 2, norm_scope 0 or 1";
    case Status::kCUDA_ERROR: return "CUDA error while launching the QKNormRoPE kernel";
    }
    return "unknown qkrope status";
}

} // namespace qkrope
