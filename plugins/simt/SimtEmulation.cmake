# SIMT emulation, the CMake face of the emulator: the emulator itself (OBJECT library simt_runtime)
# and simt_add_emulated_library(), which builds any set of CUDA sources with the host C++ compiler
# against the stand-in CUDA headers of this directory and links them with the emulator.
#
#   simt_add_emulated_library(<target>
#     SOURCES <file>...                 .cu files (compiled as C++) and .cpp files
#     [INCLUDE_DIRECTORIES <dir>...]    the sources' own include directories (after the stand-ins)
#     [CUDA_COMPILE_OPTIONS <opt>...]   extra compiler options for the .cu files only
#     [EXPORTS <glob>...]               symbols exported besides the emulator's C API (simt_*, and
#                                       the deprecated qkrope_simt_* aliases; see simt_capi.h)
#     [OUTPUT_DIRECTORY <dir>])         where lib<target>.so goes (default: CMAKE_BINARY_DIR)
#
# The result is a SHARED library; every other symbol stays local (a generated version script).
# A .cu file is compiled through a generated one-line C++ file that includes it, so the source's
# own LANGUAGE stays CUDA (a directory may build the same .cu for the GPU as well); its messages
# still name the .cu (__FILE__ is the included file's).
# Needs Linux (ucontext, dladdr, ELF) and GCC or Clang. Used by plugins/simt/CMakeLists.txt (the
# emulator's self-test) and by the projects whose kernels it emulates (plugins/kernel).
include_guard(GLOBAL)

if(NOT CMAKE_SYSTEM_NAME STREQUAL "Linux" OR NOT CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
  message(FATAL_ERROR "SIMT emulation: needs Linux and GCC or Clang (have ${CMAKE_SYSTEM_NAME}, "
                      "${CMAKE_CXX_COMPILER_ID})")
endif()

# The compile and output settings every emulated target shares (the emulator's too). The values
# live in the functions (a function sees its caller's directory variables, not this file's).
#   __CUDACC__, __CUDA_ARCH__: device code is compiled (the sources' device branches);
#   -fno-strict-aliasing: CUDA code type-puns through reinterpret_cast (nvcc tolerates it);
#   -ffp-contract=off -fno-fast-math: each fp32 operation rounded on its own, as on the device.
function(_simt_emulation_settings target)
  target_include_directories(${target} BEFORE PRIVATE ${CMAKE_CURRENT_FUNCTION_LIST_DIR})
  target_compile_definitions(${target} PRIVATE __CUDACC__ __CUDA_ARCH__=900 SIMT_EMULATION=1)
  target_compile_features(${target} PRIVATE cxx_std_17)
  target_compile_options(${target} PRIVATE
    -O2 -Wall -Wextra -ffp-contract=off -fno-fast-math -fno-strict-aliasing)
  set_target_properties(${target} PROPERTIES
    CXX_EXTENSIONS OFF
    POSITION_INDEPENDENT_CODE ON
    CXX_VISIBILITY_PRESET hidden
    VISIBILITY_INLINES_HIDDEN ON)
endfunction()

if(NOT TARGET simt_runtime)
  set(_simt_src ${CMAKE_CURRENT_LIST_DIR}/src)
  add_library(simt_runtime OBJECT
    ${_simt_src}/simt_state.cpp
    ${_simt_src}/simt_symbols.cpp
    ${_simt_src}/simt_scheduler.cpp
    ${_simt_src}/simt_collectives.cpp
    ${_simt_src}/simt_async.cpp
    ${_simt_src}/simt_runtime_api.cpp
    ${_simt_src}/simt_capi.cpp)
  _simt_emulation_settings(simt_runtime)
endif()

function(simt_add_emulated_library target)
  cmake_parse_arguments(PARSE_ARGV 1 arg "" "OUTPUT_DIRECTORY"
                        "SOURCES;INCLUDE_DIRECTORIES;CUDA_COMPILE_OPTIONS;EXPORTS")
  if(arg_UNPARSED_ARGUMENTS)
    message(FATAL_ERROR "simt_add_emulated_library(${target}): unknown arguments ${arg_UNPARSED_ARGUMENTS}")
  endif()
  if(NOT arg_SOURCES)
    message(FATAL_ERROR "simt_add_emulated_library(${target}): no SOURCES")
  endif()
  if(NOT arg_OUTPUT_DIRECTORY)
    set(arg_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR})
  endif()

  set(gen ${CMAKE_CURRENT_BINARY_DIR}/${target}.simt)
  set(sources)
  foreach(src IN LISTS arg_SOURCES)
    get_filename_component(abs ${src} ABSOLUTE)
    if(abs MATCHES "\\.cu$")
      get_filename_component(name ${abs} NAME)
      set(wrapper ${gen}/${name}.cpp)
      file(CONFIGURE OUTPUT ${wrapper} CONTENT "#include \"${abs}\"\n" @ONLY)
      set_source_files_properties(${wrapper} PROPERTIES
        OBJECT_DEPENDS ${abs}
        COMPILE_OPTIONS "-Wno-unknown-pragmas;${arg_CUDA_COMPILE_OPTIONS}") # g++: no `#pragma unroll`
      list(APPEND sources ${wrapper})
    else()
      list(APPEND sources ${abs})
    endif()
  endforeach()

  set(map ${gen}/exports.map)
  set(globs "")
  foreach(glob IN ITEMS "simt_*" "qkrope_simt_*" ${arg_EXPORTS})
    string(APPEND globs " ${glob};")
  endforeach()
  file(CONFIGURE OUTPUT ${map} CONTENT "{\n  global:${globs}\n  local: *;\n};\n" @ONLY)

  add_library(${target} SHARED ${sources} $<TARGET_OBJECTS:simt_runtime>)
  _simt_emulation_settings(${target})
  if(arg_INCLUDE_DIRECTORIES)
    target_include_directories(${target} PRIVATE ${arg_INCLUDE_DIRECTORIES})
  endif()
  target_link_libraries(${target} PRIVATE ${CMAKE_DL_LIBS})
  target_link_options(${target} PRIVATE "LINKER:--version-script=${map}")
  set_target_properties(${target} PROPERTIES
    LINKER_LANGUAGE CXX
    LINK_DEPENDS ${map}
    LIBRARY_OUTPUT_DIRECTORY ${arg_OUTPUT_DIRECTORY}
    RUNTIME_OUTPUT_DIRECTORY ${arg_OUTPUT_DIRECTORY})
endfunction()
