// qkrope: fused per-head RMSNorm of Q and K followed by rotary embedding from a 2-D fp32
// cos/sin cache. This header is the launch interface shared by the TensorRT plugin, the C-ABI
// test/benchmark library and the CPU build of the kernel arithmetic.
//
// Contract (docs/spec.md, section 3):
//   q, k, q_out, k_out : [batch, seq_len, num_heads, head_dim], contiguous, one dtype
//   q_weight, k_weight : [head_dim] (norm_scope 0) or [num_heads * head_dim] (norm_scope 1), q's dtype
//                        or both float32 (weightsFp32: FLUX.3 keeps its norm weights in fp32)
//   cache              : [cache_rows, rotary_dim] fp32; row s = token s of the stream;
//                        columns [0, rotary_dim/2) cos, [rotary_dim/2, rotary_dim) sin
#pragma once

#include <cstdint>

// The CUDA stream type without the CUDA headers (identical to cuda_runtime_api.h's typedef), so
// host-only code can include this header.
struct CUstream_st;
typedef struct CUstream_st* cudaStream_t;

namespace qkrope
{

enum class DataType : int32_t
{
    kFLOAT32 = 0,
    kFLOAT16 = 1,
    kBFLOAT16 = 2,
};

struct QKNormRoPEParams
{
    void const* q{nullptr};
    void const* k{nullptr};
    void const* qWeight{nullptr};
    void const* kWeight{nullptr};
    float const* cache{nullptr};
    void* qOut{nullptr};
    void* kOut{nullptr};

    int64_t batch{0};
    int64_t seqLen{0};
    int64_t numHeads{0};
    int64_t headDim{0};
    int64_t rotaryDim{0};
    int64_t cacheRows{0};

    float eps{1e-6F};
    bool interleaved{true}; // true: pairs (2j, 2j+1) (GPT-J, Qwen-Image); false: (j, j+half) (NeoX)
    int32_t rounding{0};    // 0: one rounding at the end; 1: diffusers' eager order (Qwen-Image); 2: FLUX's
    int32_t normScope{0};   // 0: RMSNorm over each head's head_dim values; 1: over the token's num_heads x
                            // head_dim values (one weight per value, index h * head_dim + d), then RoPE per head
    DataType dtype{DataType::kFLOAT32};
    bool weightsFp32{false}; // q_weight and k_weight are float32 whatever dtype is (false: they are in dtype);
                             // each weight enters the fp32 arithmetic at its value (docs/spec.md section 3)
};

// Status codes returned by checkParams and the launchers. 0 is success.
enum class Status : int32_t
{
    kSUCCESS = 0,
    kNULL_POINTER = 1,
    kBAD_SHAPE = 2,          // a negative extent, head_dim odd / > kMAX_HEAD_DIM, or sizes that overflow
    kBAD_ROTARY_DIM = 3,     // rotary_dim odd, zero, or > head_dim
    kCACHE_OVERFLOW = 4,     // cache_rows < seq_len
    kBAD_DTYPE = 5,
    kBAD_ATTRIBUTE = 6,      // eps not finite or outside (0, 1) (qkrope/contract.py), rounding not 0, 1 or 2,
                             // norm_scope not 0 or 1
    kCUDA_ERROR = 7,
};

constexpr int64_t kMAX_HEAD_DIM = 512;

// norm_scope values (qkrope/contract.py NORM_SCOPE_*; docs/spec.md).
constexpr int32_t kNORM_SCOPE_HEAD = 0;
constexpr int32_t kNORM_SCOPE_ROW = 1;

// Validates everything the kernel relies on for in-bounds access. Host-only, no CUDA calls.
Status checkParams(QKNormRoPEParams const& p) noexcept;

// Human-readable text for a status (static storage).
char const* statusString(Status s) noexcept;

// Enqueues the fused kernel for q and k on `stream` (one launch). Calls checkParams first and
// returns its status without launching when it fails; kCUDA_ERROR when the launch fails (the
// CUDA error is left for the caller to read with cudaGetLastError). An empty problem (batch, seq
// or heads zero) is a successful no-op. q_out may alias q and k_out may alias k (in place).
// Implemented in qknorm_rope.cu (the qkrope_kernel_objs object library).
Status launchQKNormRoPE(QKNormRoPEParams const& p, cudaStream_t stream) noexcept;

} // namespace qkrope
