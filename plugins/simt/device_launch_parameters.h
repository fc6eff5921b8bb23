// qkrope SIMT emulation: stand-in for <device_launch_parameters.h>; threadIdx & co. are in simt.h.
#pragma once
#include "cuda_runtime.h"
