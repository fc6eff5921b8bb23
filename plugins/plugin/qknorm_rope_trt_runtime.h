// qkrope: the plugin's view of the TensorRT runtime it is loaded into, without linking it: symbol
// lookup in an already-loaded libnvinfer, the major-version check, and logging (TensorRT OSS keeps
// the same in plugin/common/: vfcCommon, the plugin logger).
#pragma once

#include <NvInferRuntime.h>

#include <cstdint>

namespace qkrope
{
namespace plugin
{

// Where TensorRT's runtime was found in this process (see lookupTensorRTSymbol).
enum class TensorRTLookup : int32_t
{
    kFOUND = 0,       // symbol found in a TensorRT of the major version this library was built for
    kABSENT = 1,      // no TensorRT runtime (or not that symbol) in the process
    kOTHER_MAJOR = 2, // TensorRT is loaded, but of another major version: not used (ABI differs)
};

struct TensorRTSymbol
{
    void* symbol{nullptr};
    TensorRTLookup status{TensorRTLookup::kABSENT};
    int32_t runtimeVersion{0};    // getInferLibVersion() of the library looked at, 0 if unknown
    char const* library{nullptr}; // soname it came from; nullptr for the global scope / none
};

// Resolves an extern "C" symbol of TensorRT's runtime without linking it: first in an
// already-loaded libnvinfer / libnvinfer_lean / libnvinfer_dispatch (.so.<built major>, .so.10,
// .so.11, unversioned; RTLD_NOLOAD: never loads anything), then, only if none is loaded, in the
// global scope (a generic name such as getLogger may belong to something else there). A library of
// another major version than NV_TENSORRT_MAJOR is never used: TensorRT 11 changed the vtables of
// ILogger, ILoggerFinder (now IVersionedInterface) and IPluginRegistry (deprecated IPluginCreator
// methods removed), so calling them through this major's headers would call the wrong methods.
// The IPluginV3 / creator interfaces the plugin implements are unchanged between 10.x and 11.x.
TensorRTSymbol lookupTensorRTSymbol(char const* name) noexcept;

// lookupTensorRTSymbol(name).symbol when its status is kFOUND, else nullptr.
void* findTensorRTSymbol(char const* name) noexcept;

// Logging: the logger from setLoggerFinder (version-compatible library; ignored when the process
// runs another TensorRT major), else TensorRT's getLogger() when libnvinfer of this major is
// loaded in the process, else stderr (warnings and errors only).
void setLoggerFinder(nvinfer1::ILoggerFinder* finder) noexcept;
void logMessage(nvinfer1::ILogger::Severity severity, char const* msg) noexcept;

} // namespace plugin
} // namespace qkrope
