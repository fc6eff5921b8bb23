# FindTensorRT: locate the TensorRT C++ headers (the plugin needs no TensorRT library to build).
#
# Search order:
#   1. -DTensorRT_INCLUDE_DIR=<dir with NvInferRuntime.h>       (explicit; wins)
#   2. -DTensorRT_ROOT=<install prefix> or env TensorRT_ROOT     (<root>/include)
#   3. standard locations: /usr/include/<multiarch> (Debian packages, NGC containers),
#      /usr/local/tensorrt/include, /opt/tensorrt/include, /usr/include
#   4. QKROPE_TRT_FALLBACK_INCLUDE_DIR (the headers scripts/fetch_trt_headers.py unpacks from the
#      PyPI wheel kernel-lens==2.0.1 into third_party/tensorrt-headers/include)
#
# A fallback picked by an earlier configure is re-checked on every configure (an install found
# later wins). TensorRT older than 10 is a FATAL_ERROR naming the version and path found.
#
# Results: TensorRT_FOUND, TensorRT_INCLUDE_DIR, TensorRT_VERSION, TensorRT_VERSION_MAJOR,
# TensorRT_SOURCE ("explicit", "install" or "fallback"), and the INTERFACE target
# TensorRT::headers (include directories marked SYSTEM, so the headers' own deprecation warnings
# stay out of our builds).

# A fallback chosen by an earlier configure is not sticky: search for an install again (one may
# have been installed since) and only fall back again if none is found.
if(TensorRT_INCLUDE_DIR AND QKROPE_TRT_FALLBACK_IN_CACHE
   AND TensorRT_INCLUDE_DIR STREQUAL QKROPE_TRT_FALLBACK_IN_CACHE)
  unset(TensorRT_INCLUDE_DIR CACHE)
  unset(TensorRT_INCLUDE_DIR)
endif()

set(_qkrope_trt_source "install")
if(TensorRT_INCLUDE_DIR)
  set(_qkrope_trt_source "explicit")
endif()

set(_qkrope_trt_roots)
if(TensorRT_ROOT)
  list(APPEND _qkrope_trt_roots "${TensorRT_ROOT}")
endif()
if(DEFINED ENV{TensorRT_ROOT} AND NOT "$ENV{TensorRT_ROOT}" STREQUAL "")
  list(APPEND _qkrope_trt_roots "$ENV{TensorRT_ROOT}")
endif()

if(_qkrope_trt_roots)
  # A root given by the user is searched before anything else.
  find_path(TensorRT_INCLUDE_DIR NvInferRuntime.h
    HINTS ${_qkrope_trt_roots}
    PATH_SUFFIXES include
    NO_DEFAULT_PATH)
endif()

if(CMAKE_LIBRARY_ARCHITECTURE)
  set(_qkrope_trt_multiarch "/usr/include/${CMAKE_LIBRARY_ARCHITECTURE}")
else()
  set(_qkrope_trt_multiarch "/usr/include/x86_64-linux-gnu" "/usr/include/aarch64-linux-gnu")
endif()
find_path(TensorRT_INCLUDE_DIR NvInferRuntime.h
  PATHS ${_qkrope_trt_multiarch}
        /usr/local/tensorrt/include
        /opt/tensorrt/include
        /usr/include
  NO_CMAKE_ENVIRONMENT_PATH NO_CMAKE_SYSTEM_PATH NO_CMAKE_PATH NO_SYSTEM_ENVIRONMENT_PATH)

if(NOT TensorRT_INCLUDE_DIR AND QKROPE_TRT_FALLBACK_INCLUDE_DIR
   AND EXISTS "${QKROPE_TRT_FALLBACK_INCLUDE_DIR}/NvInferRuntime.h")
  set(TensorRT_INCLUDE_DIR "${QKROPE_TRT_FALLBACK_INCLUDE_DIR}" CACHE PATH "TensorRT include directory" FORCE)
  set(QKROPE_TRT_FALLBACK_IN_CACHE "${QKROPE_TRT_FALLBACK_INCLUDE_DIR}" CACHE INTERNAL
      "TensorRT_INCLUDE_DIR was set to the fallback by FindTensorRT (re-searched on every configure)")
  set(_qkrope_trt_source "fallback")
else()
  unset(QKROPE_TRT_FALLBACK_IN_CACHE CACHE)
endif()
if(TensorRT_INCLUDE_DIR AND QKROPE_TRT_FALLBACK_INCLUDE_DIR
   AND TensorRT_INCLUDE_DIR STREQUAL QKROPE_TRT_FALLBACK_INCLUDE_DIR)
  set(_qkrope_trt_source "fallback")
endif()

if(TensorRT_INCLUDE_DIR AND EXISTS "${TensorRT_INCLUDE_DIR}/NvInferVersion.h")
  file(STRINGS "${TensorRT_INCLUDE_DIR}/NvInferVersion.h" _qkrope_trt_ver_lines
       REGEX "^#define (TRT|NV_TENSORRT)_(MAJOR|MINOR|PATCH)(_ENTERPRISE)? +[0-9]+")
  foreach(_part MAJOR MINOR PATCH)
    set(TensorRT_VERSION_${_part} "")
    foreach(_line IN LISTS _qkrope_trt_ver_lines)
      if(_line MATCHES "^#define (TRT_${_part}_ENTERPRISE|NV_TENSORRT_${_part}) +([0-9]+)")
        set(TensorRT_VERSION_${_part} "${CMAKE_MATCH_2}")
        break()
      endif()
    endforeach()
  endforeach()
  set(TensorRT_VERSION "${TensorRT_VERSION_MAJOR}.${TensorRT_VERSION_MINOR}.${TensorRT_VERSION_PATCH}")
endif()

# The plugin implements IPluginV3 (TensorRT >= 10); older headers cannot build it.
if(TensorRT_INCLUDE_DIR)
  if(NOT TensorRT_VERSION_MAJOR)
    message(FATAL_ERROR "FindTensorRT: cannot read the TensorRT version from "
                        "${TensorRT_INCLUDE_DIR}/NvInferVersion.h (missing or unrecognised); qkrope "
                        "needs TensorRT >= 10 headers. Point -DTensorRT_ROOT / -DTensorRT_INCLUDE_DIR at one.")
  elseif(TensorRT_VERSION_MAJOR LESS 10)
    message(FATAL_ERROR "FindTensorRT: found TensorRT ${TensorRT_VERSION} headers in "
                        "${TensorRT_INCLUDE_DIR}, but qkrope's plugin needs TensorRT >= 10 (IPluginV3). "
                        "Point -DTensorRT_ROOT / -DTensorRT_INCLUDE_DIR at a TensorRT 10 or 11 install, or "
                        "run scripts/fetch_trt_headers.py and pass -DTensorRT_INCLUDE_DIR="
                        "${QKROPE_TRT_FALLBACK_INCLUDE_DIR}.")
  endif()
endif()

include(FindPackageHandleStandardArgs)
find_package_handle_standard_args(TensorRT
  REQUIRED_VARS TensorRT_INCLUDE_DIR
  VERSION_VAR TensorRT_VERSION)
set(TensorRT_SOURCE "${_qkrope_trt_source}")

if(TensorRT_FOUND AND NOT TARGET TensorRT::headers)
  add_library(TensorRT::headers INTERFACE IMPORTED)
  # Imported targets' include directories are SYSTEM includes.
  set_target_properties(TensorRT::headers PROPERTIES INTERFACE_INCLUDE_DIRECTORIES "${TensorRT_INCLUDE_DIR}")
endif()
mark_as_advanced(TensorRT_INCLUDE_DIR)
