# qkrope_enable_cuda(): enable CUDA with the project's defaults, shared by plugins/CMakeLists.txt
# and the stand-alone build of plugins/kernel.
#
# Architectures, unless the user chose (-DCMAKE_CUDA_ARCHITECTURES=..., or the CUDAARCHS
# environment variable, which enable_language(CUDA) reads; never FORCEd over):
#   - a GPU is visible (nvidia-smi lists one): `native`, SASS for exactly that GPU (CMake >= 3.24;
#     older CMake: the compute capabilities nvidia-smi reports);
#   - no GPU: PTX for sm_80 only (`80-virtual`, no SASS): nothing here can run device code, and the
#     plugin libraries still link, load and register; the first CUDA use would JIT it. The build
#     prints the command for the deployable fat binary;
#   - CUDAARCHS=all or --arch all (scripts/build_plugins.sh, qkrope build-plugin): the deployable
#     fat binary QKROPE_DEPLOY_ARCHS, SASS for Ampere (80, 86), Ada (89), Hopper (90), Blackwell
#     (100) + PTX of the highest (nvcc < 12.8 does not know sm_100: stop at 90 there).
# The CUDA runtime is linked statically, so the libraries need no libcudart at load time.
set(QKROPE_CUDA_ARCHS "" CACHE STRING "'all': the deployable fat binary (QKROPE_DEPLOY_ARCHS); empty: the default")
macro(qkrope_enable_cuda)
  # A value this macro chose before (recorded in QKROPE_CUDA_ARCHS_AUTO) is not a user's choice.
  if((NOT DEFINED CMAKE_CUDA_ARCHITECTURES AND "$ENV{CUDAARCHS}" STREQUAL "")
     OR (DEFINED QKROPE_CUDA_ARCHS_AUTO AND "${CMAKE_CUDA_ARCHITECTURES}" STREQUAL "${QKROPE_CUDA_ARCHS_AUTO}"))
    set(_qkrope_default_archs ON)
  endif()
  set(CMAKE_CUDA_RUNTIME_LIBRARY Static)
  enable_language(CUDA)
  if(CMAKE_CUDA_COMPILER_VERSION VERSION_LESS 12.8)
    set(QKROPE_DEPLOY_ARCHS "80-real;86-real;89-real;90")
  else()
    set(QKROPE_DEPLOY_ARCHS "80-real;86-real;89-real;90-real;100")
  endif()
  if(QKROPE_CUDA_ARCHS STREQUAL "all")
    set(CMAKE_CUDA_ARCHITECTURES "${QKROPE_DEPLOY_ARCHS}" CACHE STRING "CUDA architectures (deployable)" FORCE)
    set(QKROPE_CUDA_ARCHS_AUTO "${QKROPE_DEPLOY_ARCHS}" CACHE INTERNAL "")
  elseif(NOT QKROPE_CUDA_ARCHS STREQUAL "")
    message(FATAL_ERROR "QKROPE_CUDA_ARCHS='${QKROPE_CUDA_ARCHS}': expected 'all' or empty "
                        "(a list of architectures goes in CMAKE_CUDA_ARCHITECTURES)")
  elseif(_qkrope_default_archs)
    set(_qkrope_caps "")
    find_program(QKROPE_NVIDIA_SMI nvidia-smi)
    if(QKROPE_NVIDIA_SMI)
      execute_process(COMMAND ${QKROPE_NVIDIA_SMI} --query-gpu=compute_cap --format=csv,noheader
                      OUTPUT_VARIABLE _qkrope_caps RESULT_VARIABLE _qkrope_smi_rc ERROR_QUIET
                      OUTPUT_STRIP_TRAILING_WHITESPACE TIMEOUT 30)
      if(NOT _qkrope_smi_rc EQUAL 0)
        set(_qkrope_caps "")
      endif()
    endif()
    if(NOT _qkrope_caps STREQUAL "")
      if(CMAKE_VERSION VERSION_LESS 3.24)
        string(REPLACE "." "" _qkrope_caps "${_qkrope_caps}")
        string(REGEX REPLACE "[\r\n]+" ";" _qkrope_caps "${_qkrope_caps}")
        list(REMOVE_DUPLICATES _qkrope_caps)
        list(TRANSFORM _qkrope_caps APPEND "-real")
        set(_qkrope_archs "${_qkrope_caps}")
      else()
        set(_qkrope_archs native)
      endif()
      set(_qkrope_why "the GPU of this machine")
    else()
      set(_qkrope_archs "80-virtual")
      string(REPLACE ";" "," _qkrope_deploy "${QKROPE_DEPLOY_ARCHS}")
      string(CONCAT _qkrope_why "no GPU found: PTX for sm_80 only, no SASS; the deployable fat binary "
                    "(${_qkrope_deploy}): bash scripts/build_plugins.sh --arch all "
                    "(or qkrope build-plugin --arch all)")
    endif()
    set(CMAKE_CUDA_ARCHITECTURES "${_qkrope_archs}" CACHE STRING "CUDA architectures (${_qkrope_why})" FORCE)
    set(QKROPE_CUDA_ARCHS_AUTO "${_qkrope_archs}" CACHE INTERNAL "")
    message(STATUS "qkrope: CUDA architectures ${_qkrope_archs}: ${_qkrope_why}")
  endif()
  # nvcc compiles the architectures of a file in parallel (the kernel has 170 instances per arch)
  string(APPEND CMAKE_CUDA_FLAGS " --threads 0")
  set(CMAKE_CUDA_STANDARD 17)
  set(CMAKE_CUDA_STANDARD_REQUIRED ON)
  message(STATUS "qkrope: CUDA ${CMAKE_CUDA_COMPILER_VERSION}, architectures ${CMAKE_CUDA_ARCHITECTURES}")
endmacro()
