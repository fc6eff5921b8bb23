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
//     from the global symbol scope, or from an already-loaded libnvinfer.so.<major> (RTLD_NOLOAD,
//     so it is never loaded by us). When TensorRT is not in the process at load time (e.g. a test
//     or a bare dlopen) nothing is registered, the creator object simply stays alive, and loading
//     succeeds; load the library after TensorRT (import tensorrt / create the builder first).
#include "qknorm_rope_plugin.h"

#include <cstdio>
#include <cstdlib>

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
        void* sym = qkrope::plugin::findTensorRTSymbol("getPluginRegistry");
        if (sym == nullptr)
        {
            // TensorRT is not in this process: nothing to register with. The creator stays reachable
            // (function-local static) and loading still succeeds.
            if (std::getenv("QKROPE_PLUGIN_DEBUG") != nullptr)
            {
                std::fprintf(stderr,
                    "[qkrope] libqkrope_plugin.so: TensorRT (getPluginRegistry) not found in the process; "
                    "QKNormRoPE was not registered. Load TensorRT before this library.\n");
            }
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
