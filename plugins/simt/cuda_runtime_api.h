// qkrope SIMT emulation: stand-in for <cuda_runtime_api.h>; everything is in cuda_runtime.h.
#pragma once
#include "cuda_runtime.h"
