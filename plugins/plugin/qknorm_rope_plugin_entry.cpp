// qkrope: library entry points. The same sources build two libraries:
//
//   libqkrope_vc_plugin.so (QKROPE_VC_PLUGIN=1) exports exactly two C symbols, the interface that
//     IPluginRegistry::loadLibrary, `trtexec --dynamicPlugins` and version-compatible engines use:
//         IPluginCreatorInterface* const* getCreators(int32_t& nbCreators)
//         void setLoggerFinder(ILoggerFinder* finder)
//     It registers nothing by itself.
//
//   libqkrope_plugin.so (QKROPE_VC_PLUGIN=0) exports nothing; a static initialiser registers the
//     creator with TensorRT's plugin registry when the library is loaded (LD_PRELOAD, dlopen,
//     `polygraphy --plugins`, `trtexec --staticPlugins`, Triton's `plugins=` backend config).
//     The library is not linked against libnvinfer: `getPluginRegistry` is resolved at load time
//     from an already-loaded libnvinfer.so.<major> (.so.10, .so.11, lean, dispatch; RTLD_NOLOAD,
//     so it is never loaded by us), else from the global symbol scope. When TensorRT is not in the
//     process at load time (e.g. a test or a bare dlopen) nothing is registered (one line on
//     stderr says so), the creator object simply stays alive, and loading succeeds; load the
//     library after TensorRT (import tensorrt / create the builder first). A TensorRT of another
//     major than the headers it was built with is refused with a message (registry ABI differs).
#include "qknorm_rope_plugin.h"
#include "qknorm_rope_trt_runtime.h"

#include <cstdio>

#define QKROPE_ENTRY_STR2(x) #x
#define QKROPE_ENTRY_STR(x) QKROPE_ENTRY_STR2(x)

#ifndef QKROPE_VC_PLUGIN
#define QKROPE_VC_PLUGIN 0
#endif

namespace
{

qkrope::plugin::QKNormRoPEPluginCreator& theCreator() noexcept
{
    static qkrope::plugin::QKNormRoPEPluginCreator sCreator;
    return sCreator;
}

} // namespace

#if QKROPE_VC_PLUGIN

extern "C" __attribute__((visibility("default"))) nvinfer1::IPluginCreatorInterface* const* getCreators(
    int32_t& nbCreators)
{
    static nvinfer1::IPluginCreatorInterface* const sCreators[] = {&theCreator()};
    nbCreators = 1;
    return sCreators;
}

extern "C" __attribute__((visibility("default"))) void setLoggerFinder(nvinfer1::ILoggerFinder* finder)
{
    qkrope::plugin::setLoggerFinder(finder);
}

#else

namespace
{

struct SelfRegistration
{
    SelfRegistration() noexcept
    {
        using GetRegistryFn = nvinfer1::IPluginRegistry* (*) ();
        qkrope::plugin::TensorRTSymbol const trt = qkrope::plugin::lookupTensorRTSymbol("getPluginRegistry");
        void* sym = trt.symbol;
        if (trt.status == qkrope::plugin::TensorRTLookup::kOTHER_MAJOR)
        {
            // The registry's vtable differs between majors (11.x dropped the deprecated
            // IPluginCreator methods): registerCreator would call another method. Refuse loudly.
            std::fprintf(stderr,
                "[qkrope] libqkrope_plugin.so: QKNormRoPE not registered: this library was built with "
                "TensorRT " QKROPE_ENTRY_STR(NV_TENSORRT_MAJOR) " headers but the process runs TensorRT %d.%d "
                "(%s), whose IPluginRegistry/ILogger ABI differs. Rebuild it with that TensorRT's headers "
                "(bash scripts/build_plugins.sh --tensorrt-root <TensorRT>), or load libqkrope_vc_plugin.so "
                "with IPluginRegistry::loadLibrary.\n",
                trt.runtimeVersion / 10000, trt.runtimeVersion / 100 % 100, trt.library ? trt.library : "global scope");
            return;
        }
        if (sym == nullptr)
        {
            // TensorRT is not in this process: nothing to register with. The creator stays reachable
            // (function-local static) and loading still succeeds. Said once, always: a silent
            // non-registration shows up much later as "plugin not found" from the ONNX parser.
            std::fprintf(stderr,
                "[qkrope] libqkrope_plugin.so: QKNormRoPE not registered: no TensorRT in this process "
                "(getPluginRegistry not found in libnvinfer.so.10/.so.11, lean/dispatch or the global "
                "scope). Load TensorRT before this library.\n");
            return;
        }
        nvinfer1::IPluginRegistry* registry = reinterpret_cast<GetRegistryFn>(sym)();
        if (registry == nullptr)
        {
            return;
        }
        auto& creator = theCreator();
        if (!registry->registerCreator(creator, creator.getPluginNamespace()))
        {
            qkrope::plugin::logMessage(nvinfer1::ILogger::Severity::kWARNING,
                "QKNormRoPE plugin: registering qkrope::QKNormRoPE v1 failed (already registered by another "
                "copy of the library?)");
        }
    }
};

SelfRegistration const gSelfRegistration;

} // namespace

#endif
