# qkrope_enable_cuda(): enable CUDA with the project's defaults, shared by plugins/CMakeLists.txt
# and the stand-alone build of plugins/kernel.
#
# Default architectures: SASS for Ampere (80, 86), Ada (89), Hopper (90), Blackwell (100) and PTX
# of the highest for forward compatibility; nvcc < 12.8 does not know sm_100, so stop at 90 there.
# A user's choice wins: -DCMAKE_CUDA_ARCHITECTURES=..., or the CUDAARCHS environment variable
# (enable_language(CUDA) initialises CMAKE_CUDA_ARCHITECTURES from it; never FORCE over it).
# The CUDA runtime is linked statically, so the libraries need no libcudart at load time.
macro(qkrope_enable_cuda)
  if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES AND "$ENV{CUDAARCHS}" STREQUAL "")
    set(_qkrope_default_archs ON)
  endif()
  set(CMAKE_CUDA_RUNTIME_LIBRARY Static)
  enable_language(CUDA)
  if(_qkrope_default_archs)
    if(CMAKE_CUDA_COMPILER_VERSION VERSION_LESS 12.8)
      set(_qkrope_archs "80-real;86-real;89-real;90")
    else()
      set(_qkrope_archs "80-real;86-real;89-real;90-real;100")
    endif()
    set(CMAKE_CUDA_ARCHITECTURES "${_qkrope_archs}" CACHE STRING
        "CUDA architectures (default: SASS 80;86;89;90;100 + PTX of the highest)" FORCE)
  endif()
  # nvcc compiles the architectures of a file in parallel (the kernel has ~230 instances per arch)
  string(APPEND CMAKE_CUDA_FLAGS " --threads 0")
  set(CMAKE_CUDA_STANDARD 17)
  set(CMAKE_CUDA_STANDARD_REQUIRED ON)
  message(STATUS "qkrope: CUDA ${CMAKE_CUDA_COMPILER_VERSION}, architectures ${CMAKE_CUDA_ARCHITECTURES}")
endmacro()
