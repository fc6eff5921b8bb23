// qkrope: TensorRT symbol lookup, major-version check and logging (see the header).
#include "qknorm_rope_trt_runtime.h"

#include <dlfcn.h>

#include <atomic>
#include <cstdio>

namespace qkrope
{
namespace plugin
{

using nvinfer1::ILogger;

namespace
{

#define QKROPE_STR2(x) #x
#define QKROPE_STR(x) QKROPE_STR2(x)

std::atomic<nvinfer1::ILoggerFinder*> gLoggerFinder{nullptr};

// getInferLibVersion() of a handle (or RTLD_DEFAULT); 0 when it does not export one.
int32_t runtimeVersionOf(void* handle) noexcept
{
    using VersionFn = int32_t (*)();
    void* sym = dlsym(handle, "getInferLibVersion");
    return sym != nullptr ? reinterpret_cast<VersionFn>(sym)() : 0;
}

bool sameMajor(int32_t version) noexcept
{
    // getInferLibVersion(): (MAJOR * 100 + MINOR) * 100 + PATCH. Unknown (0) counts as compatible.
    return version == 0 || version / 10000 == NV_TENSORRT_MAJOR;
}

char const* severityName(ILogger::Severity s) noexcept
{
    switch (s)
    {
    case ILogger::Severity::kINTERNAL_ERROR: return "INTERNAL_ERROR";
    case ILogger::Severity::kERROR: return "ERROR";
    case ILogger::Severity::kWARNING: return "WARNING";
    case ILogger::Severity::kINFO: return "INFO";
    case ILogger::Severity::kVERBOSE: return "VERBOSE";
    }
    return "LOG";
}

ILogger* findLogger() noexcept
{
    try
    {
        if (nvinfer1::ILoggerFinder* finder = gLoggerFinder.load())
        {
            if (ILogger* logger = finder->findLogger())
            {
                return logger;
            }
        }
    }
    catch (...) // the finder is the host's code: nothing it throws may cross back into TensorRT
    {
    }
    using GetLoggerFn = ILogger* (*) ();
    if (void* sym = findTensorRTSymbol("getLogger"))
    {
        return reinterpret_cast<GetLoggerFn>(sym)();
    }
    return nullptr;
}

} // namespace

TensorRTSymbol lookupTensorRTSymbol(char const* name) noexcept
{
    // TensorRT loaded with RTLD_LOCAL (Python's `import tensorrt`, Triton's backend) is only
    // reachable through its handle; RTLD_NOLOAD never loads anything. The built major first, then
    // 10 and 11 explicitly, so a build is found whichever major the process runs (and a mismatch
    // is reported rather than silently ignored).
    static char const* const kLibs[] = {
        "libnvinfer.so." QKROPE_STR(NV_TENSORRT_MAJOR),
        "libnvinfer.so.10",
        "libnvinfer.so.11",
        "libnvinfer.so",
        "libnvinfer_lean.so." QKROPE_STR(NV_TENSORRT_MAJOR),
        "libnvinfer_lean.so.10",
        "libnvinfer_lean.so.11",
        "libnvinfer_dispatch.so." QKROPE_STR(NV_TENSORRT_MAJOR),
        "libnvinfer_dispatch.so.10",
        "libnvinfer_dispatch.so.11",
    };
    TensorRTSymbol other;
    bool anyLoaded = false;
    for (char const* lib : kLibs)
    {
        void* handle = dlopen(lib, RTLD_LAZY | RTLD_NOLOAD);
        if (handle == nullptr)
        {
            continue;
        }
        anyLoaded = true;
        int32_t const version = runtimeVersionOf(handle);
        void* sym = dlsym(handle, name);
        dlclose(handle); // drops only the reference RTLD_NOLOAD added
        if (!sameMajor(version))
        {
            if (other.status != TensorRTLookup::kOTHER_MAJOR)
            {
                other.status = TensorRTLookup::kOTHER_MAJOR;
                other.runtimeVersion = version;
                other.library = lib;
            }
            continue;
        }
        if (sym != nullptr)
        {
            return TensorRTSymbol{sym, TensorRTLookup::kFOUND, version, lib};
        }
    }
    if (other.status == TensorRTLookup::kOTHER_MAJOR)
    {
        return other; // never fall back to the global scope: it would resolve to that TensorRT
    }
    if (!anyLoaded)
    {
        // No libnvinfer by any of those names (e.g. TensorRT linked statically into the executable,
        // or a test's stand-ins): the global scope, checked for a version too when it has one.
        if (void* sym = dlsym(RTLD_DEFAULT, name))
        {
            int32_t const version = runtimeVersionOf(RTLD_DEFAULT);
            if (!sameMajor(version))
            {
                return TensorRTSymbol{nullptr, TensorRTLookup::kOTHER_MAJOR, version, nullptr};
            }
            return TensorRTSymbol{sym, TensorRTLookup::kFOUND, version, nullptr};
        }
    }
    return TensorRTSymbol{};
}

void* findTensorRTSymbol(char const* name) noexcept
{
    TensorRTSymbol const s = lookupTensorRTSymbol(name);
    return s.status == TensorRTLookup::kFOUND ? s.symbol : nullptr;
}

void setLoggerFinder(nvinfer1::ILoggerFinder* finder) noexcept
{
    if (finder == nullptr)
    {
        return;
    }
    // The finder's vtable is that of the TensorRT that calls us: with another major (11.x finders
    // derive from IVersionedInterface) findLogger() would be the wrong slot. Ignore it then;
    // messages go to stderr.
    TensorRTSymbol const trt = lookupTensorRTSymbol("getInferLibVersion");
    if (trt.status == TensorRTLookup::kOTHER_MAJOR)
    {
        static std::atomic<bool> warned{false};
        if (!warned.exchange(true))
        {
            std::fprintf(stderr,
                "[qkrope] QKNormRoPE plugin built with TensorRT " QKROPE_STR(NV_TENSORRT_MAJOR)
                " headers runs in TensorRT %d.%d (%s): its logger is not used (ILogger ABI differs), "
                "messages go to stderr\n",
                trt.runtimeVersion / 10000, trt.runtimeVersion / 100 % 100, trt.library ? trt.library : "?");
        }
        return;
    }
    nvinfer1::ILoggerFinder* expected = nullptr;
    gLoggerFinder.compare_exchange_strong(expected, finder);
}

void logMessage(ILogger::Severity severity, char const* msg) noexcept
{
    try
    {
        if (ILogger* logger = findLogger())
        {
            logger->log(severity, msg);
            return;
        }
    }
    catch (...) // a host logger that throws: fall back to stderr
    {
    }
    if (severity <= ILogger::Severity::kWARNING)
    {
        std::fprintf(stderr, "[qkrope] %s: %s\n", severityName(severity), msg);
    }
}

} // namespace plugin
} // namespace qkrope
