// qkrope fuzz build: stand-in for <cuda_runtime_api.h>. TensorRT's NvInferRuntimeBase.h includes
// it only for the opaque handle types below (declared exactly as the CUDA runtime declares them), and
// the plugin sources use nothing else from CUDA, so the sanitized fuzz build needs no CUDA toolkit.
#pragma once

struct CUstream_st;
typedef struct CUstream_st* cudaStream_t;
struct CUevent_st;
typedef struct CUevent_st* cudaEvent_t;
