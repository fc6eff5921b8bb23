// qkrope: what the pieces of the host-side contract test driver share (internal to
// qkrope_plugin_host_test): the PASS/FAIL reporting, the driver's arguments, the plugin helpers
// (capabilities, creation, reading the attributes back, tensor descriptors, malformed ranks) and
// the test functions of each piece. The driver (main, the two libraries) is plugin_host_test.cpp;
// the checks live in plugin_host_test_fields.cpp (creator, createPlugin, bad fields),
// plugin_host_test_build.cpp (IPluginV3OneBuild) and plugin_host_test_runtime.cpp
// (IPluginV3OneRuntime, serialisation, clone); the helpers in plugin_host_test_support.cpp.
#pragma once

#include "fake_tensorrt_host.h"
#include "qknorm_rope_fields.h"

#include <NvInferRuntime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace qkrope_host_test
{

using namespace nvinfer1;
using qkrope::plugin::fieldTypeName;
using qkrope_test::FakeExprBuilder;
using qkrope_test::Fields;
using qkrope_test::parserFields;
using qkrope_test::RecordingLogger;

// ---- reporting (plugin_host_test.cpp) ---------------------------------------------------------

// Prints "PASS <name>" or "FAIL <name>: <detail>" and counts it.
void check(bool ok, std::string const& name, std::string const& detail = {});

// The needles missing from msg, as " 'a' 'b'"; empty when all occur.
std::string missingFrom(std::string const& msg, std::vector<char const*> const& needles);

// A refusal: the expected return code, exactly one error logged since `mark`, naming every needle.
void checkRefusal(std::string const& name, int32_t rc, int32_t expected, RecordingLogger const& logger, size_t mark,
    std::vector<char const*> const& needles);

// ---- arguments (parsed by plugin_host_test.cpp) -----------------------------------------------

struct Args
{
    std::string vc;
    std::string plugin;
    std::string name{"QKNormRoPE"};
    std::string version{"1"};
    std::string ns{"qkrope"};
    std::vector<std::pair<std::string, std::string>> fields; // name, type
    std::map<std::string, double> defaults;

    double defaultOf(char const* field, double fallback) const
    {
        auto it = defaults.find(field);
        return it != defaults.end() ? it->second : fallback;
    }
};

// ---- plugin helpers (plugin_host_test_support.cpp) --------------------------------------------

char const* typeName(DataType t);

using PluginPtr = std::unique_ptr<IPluginV3>;

IPluginV3OneRuntime* runtimeOf(IPluginV3* p);
IPluginV3OneBuild* buildOf(IPluginV3* p);
IPluginV3OneCore* coreOf(IPluginV3* p);

PluginPtr create(IPluginCreatorV3One* c, Fields* f, TensorRTPhase phase = TensorRTPhase::kBUILD,
    char const* name = "test_node");
// create(c, f) for a check group: on a refusal, reports "<group>.create" failed (with the creator's
// log) and returns null, so the group stops there.
PluginPtr createFor(char const* group, IPluginCreatorV3One* c, Fields* f, RecordingLogger const& logger);

struct Attrs
{
    float eps{std::nanf("")};
    int32_t interleaved{-99};
    int32_t rounding{-99};
    int32_t normScope{-99};
    std::string error;

    bool equals(float e, int32_t il, int32_t r, int32_t ns = 0) const
    {
        return error.empty() && eps == e && interleaved == il && rounding == r && normScope == ns;
    }
    std::string str() const;
};

// Reads the attributes back through getFieldsToSerialize (the only public view of them).
Attrs serializedAttrs(IPluginV3* p);

// Attributes of a created plugin for a check's detail; the last message when creation failed.
std::string describe(IPluginV3* p, RecordingLogger const& logger);

Dims makeDims(std::vector<int64_t> const& v);
PluginTensorDesc makeDesc(std::vector<int64_t> const& dims, DataType t, TensorFormat f = TensorFormat::kLINEAR);

struct Shapes
{
    std::vector<int64_t> q, k, qw, kw, cache;
};

Shapes goodShapes();

// q, k, q_weight, k_weight, cos_sin_cache, q_out, k_out.
std::vector<PluginTensorDesc> descs(Shapes const& s, DataType t, DataType cacheType = DataType::kFLOAT);
std::vector<DynamicPluginTensorDesc> dynDescs(Shapes const& s, DataType t);

// Dims no TensorRT produces: a rank outside [0, Dims::MAX_DIMS] on one tensor (IOIndex: 0-4 the
// inputs, 5-6 the outputs). Entry points must refuse them before reading (or printing) an extent.
struct BadRank
{
    char const* name;
    int32_t tensor;
    int32_t nbDims;
    std::vector<char const*> needles;
};

std::vector<BadRank> badRankCases();
void setRank(Dims& d, int32_t nbDims);

// ---- the checks, one function per group -------------------------------------------------------

// plugin_host_test_fields.cpp: creator identity and field list, createPlugin, bad fields.
void testCreator(IPluginCreatorV3One* creator, Args const& args);
void testCreate(IPluginCreatorV3One* c, Args const& args, RecordingLogger& logger);
void testBadFields(IPluginCreatorV3One* c, RecordingLogger& logger);

// plugin_host_test_build.cpp: the build-time capability.
void testPluginCore(IPluginV3OneCore* core, IPluginV3OneBuild* build, IPluginV3OneRuntime* rt);
void testOutputShapes(IPluginV3OneBuild* build, RecordingLogger& logger);
void testFormats(IPluginV3OneBuild* build);
void testOutputDataTypes(IPluginV3OneBuild* build, RecordingLogger& logger);
void testConfigure(IPluginV3OneBuild* build, RecordingLogger& logger);

// plugin_host_test_runtime.cpp: the run-time capability, serialisation, clone, attachToContext.
void testShapeChange(IPluginV3OneRuntime* rt, RecordingLogger& logger);
void testEnqueue(IPluginV3OneRuntime* rt, RecordingLogger& logger);
void testSerialize(IPluginCreatorV3One* c, RecordingLogger& logger);
void testClone(IPluginCreatorV3One* c, RecordingLogger& logger);
void testAttachToContext(IPluginCreatorV3One* c, RecordingLogger& logger);

} // namespace qkrope_host_test
