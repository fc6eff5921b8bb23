// qkrope: host-side contract test of the QKNormRoPE TensorRT plugin. Needs neither a GPU nor
// libnvinfer: it dlopens the plugin libraries and drives the IPluginV3 interfaces the way
// TensorRT and its ONNX parser do (the stand-ins are in fake_tensorrt_host.h). Driven by
// tests/test_plugin_host.py; one test function per capability, named after its check group.
//
// Usage: qkrope_plugin_host_test --vc <libqkrope_vc_plugin.so> --plugin <libqkrope_plugin.so>
//            [--expect-name N] [--expect-version V] [--expect-namespace NS]
//            [--expect-field name:kTYPE]... [--default name=value]...
// Output: one line per check, "PASS <check>" or "FAIL <check>: <detail>"; "FIELD <name> <type>
// <length>" for each creator field, "SERIALIZED <name> <type> <length>" for each serialised field,
// "MESSAGE <case> <text>" for each bad-field message; "SUMMARY passed=<n> failed=<m>" last.
// Exit status 0 iff nothing failed.
//
// This file is the driver: the fake TensorRT entry points, the reporting, the arguments, the two
// libraries' tests and main. The checks of each capability are in plugin_host_test_fields.cpp,
// plugin_host_test_build.cpp and plugin_host_test_runtime.cpp; what they share is declared in
// plugin_host_test.h.
#include "plugin_host_test.h"

#include <NvInferRuntime.h>

#include <dlfcn.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

using namespace nvinfer1;
using qkrope_test::FakeRegistry;
using qkrope_test::FixedLoggerFinder;
using qkrope_test::RecordingLogger;

namespace
{

RecordingLogger gFinderLogger; // reached through setLoggerFinder (VC library)
RecordingLogger gGlobalLogger; // reached through the fake getLogger() below
FixedLoggerFinder gFinder{gFinderLogger};
FakeRegistry gRegistry;
int gRegistryCalls = 0;

} // namespace

// Exported from this executable (-rdynamic) under TensorRT's names: libqkrope_plugin.so finds them
// through dlsym in the global scope because no libnvinfer is loaded.
extern "C" __attribute__((visibility("default"))) IPluginRegistry* getPluginRegistry() noexcept
{
    ++gRegistryCalls;
    return &gRegistry;
}

extern "C" __attribute__((visibility("default"))) ILogger* getLogger() noexcept
{
    return &gGlobalLogger;
}

namespace qkrope_host_test
{

// ---- reporting -------------------------------------------------------------------------------

namespace
{

int gPassed = 0;
int gFailed = 0;

} // namespace

void check(bool ok, std::string const& name, std::string const& detail)
{
    if (ok)
    {
        ++gPassed;
        std::printf("PASS %s\n", name.c_str());
    }
    else
    {
        ++gFailed;
        std::printf("FAIL %s: %s\n", name.c_str(), detail.empty() ? "check failed" : detail.c_str());
    }
    std::fflush(stdout);
}

std::string missingFrom(std::string const& msg, std::vector<char const*> const& needles)
{
    std::string missing;
    for (char const* n : needles)
    {
        if (msg.find(n) == std::string::npos)
        {
            missing += std::string(" '") + n + "'";
        }
    }
    return missing;
}

void checkRefusal(std::string const& name, int32_t rc, int32_t expected, RecordingLogger const& logger, size_t mark,
    std::vector<char const*> const& needles)
{
    std::string const msg = logger.lastSince(mark);
    std::string const missing = missingFrom(msg, needles);
    size_t const errors = logger.errorsSince(mark);
    check(rc == expected && errors == 1 && missing.empty(), name,
        "rc " + std::to_string(rc) + " (expected " + std::to_string(expected) + "), errors " + std::to_string(errors)
            + (missing.empty() ? "" : ", message lacks" + missing) + ": " + msg);
}

namespace
{

// ---- arguments -------------------------------------------------------------------------------

int parseArgs(int argc, char** argv, Args& a)
{
    for (int i = 1; i < argc; ++i)
    {
        std::string const k = argv[i];
        if (i + 1 >= argc)
        {
            std::fprintf(stderr, "missing value after %s\n", k.c_str());
            return 2;
        }
        std::string const v = argv[++i];
        if (k == "--vc")
            a.vc = v;
        else if (k == "--plugin")
            a.plugin = v;
        else if (k == "--expect-name")
            a.name = v;
        else if (k == "--expect-version")
            a.version = v;
        else if (k == "--expect-namespace")
            a.ns = v;
        else if (k == "--expect-field")
        {
            auto c = v.find(':');
            a.fields.emplace_back(v.substr(0, c), c == std::string::npos ? "" : v.substr(c + 1));
        }
        else if (k == "--default")
        {
            auto e = v.find('=');
            a.defaults[v.substr(0, e)] = std::atof(v.substr(e + 1).c_str());
        }
        else
        {
            std::fprintf(stderr, "unknown argument %s\n", k.c_str());
            return 2;
        }
    }
    if (a.vc.empty() || a.plugin.empty())
    {
        std::fprintf(stderr, "usage: %s --vc LIB --plugin LIB [--expect-field name:kTYPE]...\n", argv[0]);
        return 2;
    }
    return 0;
}

// Every capability of a plugin created from the parser's fields.
void testPlugin(IPluginCreatorV3One* c, RecordingLogger& logger)
{
    Fields f = parserFields(1e-6F, 1, 0);
    PluginPtr p = createFor("plugin", c, &f, logger);
    if (p == nullptr)
    {
        return;
    }
    IPluginV3OneCore* core = coreOf(p.get());
    IPluginV3OneBuild* build = buildOf(p.get());
    IPluginV3OneRuntime* rt = runtimeOf(p.get());
    check(core && build && rt, "plugin.capabilities");
    if (!(core && build && rt))
    {
        return;
    }
    testPluginCore(core, build, rt);
    testOutputShapes(build, logger);
    testFormats(build);
    testOutputDataTypes(build, logger);
    testConfigure(build, logger);
    testShapeChange(rt, logger);
    testEnqueue(rt, logger);
    testSerialize(c, logger);
    testClone(c, logger);
    testAttachToContext(c, logger);
}

// ---- vc: the version-compatible library (getCreators + setLoggerFinder only) ------------------

using GetCreatorsFn = IPluginCreatorInterface* const* (*) (int32_t&);
using SetLoggerFinderFn = void (*)(ILoggerFinder*);

void testVcLibrary(Args const& args)
{
    void* vc = dlopen(args.vc.c_str(), RTLD_NOW | RTLD_LOCAL);
    check(vc != nullptr, "vc.dlopen", vc ? "" : dlerror());
    if (vc == nullptr)
    {
        return;
    }
    auto getCreators = reinterpret_cast<GetCreatorsFn>(dlsym(vc, "getCreators"));
    auto setFinder = reinterpret_cast<SetLoggerFinderFn>(dlsym(vc, "setLoggerFinder"));
    check(getCreators != nullptr && setFinder != nullptr, "vc.entry_points");
    check(gRegistry.entries.empty() && gRegistryCalls == 0, "vc.no_self_registration",
        std::to_string(gRegistryCalls) + " getPluginRegistry calls");
    if (!getCreators || !setFinder)
    {
        return;
    }
    setFinder(&gFinder);
    int32_t n = -1;
    IPluginCreatorInterface* const* creators = getCreators(n);
    check(n == 1 && creators != nullptr && creators[0] != nullptr, "vc.get_creators", std::to_string(n));
    if (n != 1 || !creators || !creators[0])
    {
        return;
    }
    auto* creator = static_cast<IPluginCreatorV3One*>(creators[0]);
    testCreator(creator, args);
    size_t const globalBefore = gGlobalLogger.mark();
    testCreate(creator, args, gFinderLogger);
    testBadFields(creator, gFinderLogger);
    testPlugin(creator, gFinderLogger);
    check(gGlobalLogger.mark() == globalBefore && !gFinderLogger.messages.empty(), "vc.logs_through_logger_finder",
        std::to_string(gGlobalLogger.mark() - globalBefore) + " messages went elsewhere");
    int32_t n2 = -1;
    check(getCreators(n2)[0] == creators[0] && n2 == 1, "vc.get_creators_stable");
}

// ---- plugin: the self-registering library (registers with getPluginRegistry() when loaded) ----

void testSelfRegisteringLibrary(Args const& args)
{
    void* lib = dlopen(args.plugin.c_str(), RTLD_NOW | RTLD_LOCAL);
    check(lib != nullptr, "plugin.dlopen", lib ? "" : dlerror());
    if (lib == nullptr)
    {
        return;
    }
    check(dlsym(lib, "getCreators") == nullptr && dlsym(lib, "setLoggerFinder") == nullptr, "plugin.exports_nothing");
    check(gRegistry.entries.size() == 1, "plugin.self_registration",
        std::to_string(gRegistry.entries.size()) + " creators registered");
    if (gRegistry.entries.size() != 1)
    {
        return;
    }
    auto* creator = static_cast<IPluginCreatorV3One*>(gRegistry.entries[0].creator);
    check(std::string(creator->getInterfaceInfo().kind) == "PLUGIN CREATOR_V3ONE"
            && std::string(creator->getPluginName()) == args.name
            && std::string(creator->getPluginVersion()) == args.version
            && std::string(creator->getPluginNamespace()) == args.ns,
        "plugin.registered_creator_identity");
    check(gRegistry.entries[0].ns == args.ns, "plugin.registered_namespace", gRegistry.entries[0].ns);
    // Without a logger finder, messages go to TensorRT's getLogger() (the fake above).
    Fields f;
    f.add("rounding", int32_t{7}, PluginFieldType::kINT32);
    size_t const mark = gGlobalLogger.mark();
    PluginPtr p(creator->createPlugin("reg_node", f.get(), TensorRTPhase::kBUILD));
    check(p == nullptr && gGlobalLogger.errorsSince(mark) == 1, "plugin.logs_through_get_logger",
        gGlobalLogger.lastSince(mark));
    Fields g = parserFields(1e-6F, 1, 0);
    p.reset(creator->createPlugin("reg_node", g.get(), TensorRTPhase::kBUILD));
    check(p != nullptr, "plugin.registered_creator_creates");
}

} // namespace

} // namespace qkrope_host_test

int main(int argc, char** argv)
{
    namespace t = qkrope_host_test;
    t::Args args;
    if (int rc = t::parseArgs(argc, argv, args))
    {
        return rc;
    }
    t::testVcLibrary(args);              // first: no library has registered anything yet
    t::testSelfRegisteringLibrary(args); // its static initialiser calls getPluginRegistry() on dlopen
    std::printf("SUMMARY passed=%d failed=%d\n", t::gPassed, t::gFailed);
    // Libraries are left loaded: static destructors run at exit in the usual order.
    return t::gFailed == 0 ? 0 : 1;
}
