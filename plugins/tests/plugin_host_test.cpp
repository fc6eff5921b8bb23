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
#include "fake_tensorrt_host.h"
#include "qknorm_rope_fields.h"

#include <NvInferRuntime.h>

#include <dlfcn.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

using namespace nvinfer1;
using qkrope::plugin::fieldTypeName;
using qkrope_test::FakeExprBuilder;
using qkrope_test::FakeRegistry;
using qkrope_test::Fields;
using qkrope_test::FixedLoggerFinder;
using qkrope_test::parserFields;
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

namespace
{

// ---- reporting -------------------------------------------------------------------------------

int gPassed = 0;
int gFailed = 0;

void check(bool ok, std::string const& name, std::string const& detail = {})
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

// The needles missing from msg, as " 'a' 'b'"; empty when all occur.
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

// A refusal: the expected return code, exactly one error logged since `mark`, naming every needle.
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

char const* typeName(DataType t)
{
    switch (t)
    {
    case DataType::kFLOAT: return "fp32";
    case DataType::kHALF: return "fp16";
    case DataType::kBF16: return "bf16";
    case DataType::kINT8: return "int8";
    case DataType::kINT32: return "int32";
    case DataType::kINT64: return "int64";
    case DataType::kBOOL: return "bool";
    default: return "other";
    }
}

// ---- arguments -------------------------------------------------------------------------------

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

// ---- plugin helpers --------------------------------------------------------------------------

using PluginPtr = std::unique_ptr<IPluginV3>;

IPluginV3OneRuntime* runtimeOf(IPluginV3* p)
{
    return static_cast<IPluginV3OneRuntime*>(p->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
}
IPluginV3OneBuild* buildOf(IPluginV3* p)
{
    return static_cast<IPluginV3OneBuild*>(p->getCapabilityInterface(PluginCapabilityType::kBUILD));
}
IPluginV3OneCore* coreOf(IPluginV3* p)
{
    return static_cast<IPluginV3OneCore*>(p->getCapabilityInterface(PluginCapabilityType::kCORE));
}

PluginPtr create(IPluginCreatorV3One* c, Fields* f, TensorRTPhase phase = TensorRTPhase::kBUILD,
    char const* name = "test_node")
{
    return PluginPtr(c->createPlugin(name, f ? f->get() : nullptr, phase));
}

struct Attrs
{
    float eps{std::nanf("")};
    int32_t interleaved{-99};
    int32_t rounding{-99};
    std::string error;

    bool equals(float e, int32_t il, int32_t r) const
    {
        return error.empty() && eps == e && interleaved == il && rounding == r;
    }
    std::string str() const
    {
        char buf[160];
        std::snprintf(buf, sizeof(buf), "epsilon=%.9g interleaved=%d rounding=%d %s", static_cast<double>(eps),
            interleaved, rounding, error.c_str());
        return buf;
    }
};

// Reads the attributes back through getFieldsToSerialize (the only public view of them).
Attrs serializedAttrs(IPluginV3* p)
{
    Attrs a;
    PluginFieldCollection const* fc = runtimeOf(p)->getFieldsToSerialize();
    if (fc == nullptr)
    {
        a.error = "getFieldsToSerialize returned null";
        return a;
    }
    for (int32_t i = 0; i < fc->nbFields; ++i)
    {
        PluginField const& f = fc->fields[i];
        std::string const n = f.name ? f.name : "";
        if (n == "epsilon" && f.type == PluginFieldType::kFLOAT32 && f.length == 1)
        {
            a.eps = *static_cast<float const*>(f.data);
        }
        else if (n == "interleaved" && f.type == PluginFieldType::kINT32 && f.length == 1)
        {
            a.interleaved = *static_cast<int32_t const*>(f.data);
        }
        else if (n == "rounding" && f.type == PluginFieldType::kINT32 && f.length == 1)
        {
            a.rounding = *static_cast<int32_t const*>(f.data);
        }
        else
        {
            a.error += "unexpected serialized field '" + n + "' (" + fieldTypeName(f.type) + ", length "
                + std::to_string(f.length) + "); ";
        }
    }
    return a;
}

// Attributes of a created plugin for a check's detail; the last message when creation failed.
std::string describe(IPluginV3* p, RecordingLogger const& logger)
{
    return p ? serializedAttrs(p).str() : logger.lastSince(0);
}

Dims makeDims(std::vector<int64_t> const& v)
{
    Dims d{};
    d.nbDims = static_cast<int32_t>(v.size());
    for (size_t i = 0; i < v.size(); ++i)
    {
        d.d[i] = v[i];
    }
    return d;
}

PluginTensorDesc makeDesc(std::vector<int64_t> const& dims, DataType t, TensorFormat f = TensorFormat::kLINEAR)
{
    PluginTensorDesc d{};
    d.dims = makeDims(dims);
    d.type = t;
    d.format = f;
    d.scale = 1.0F;
    return d;
}

struct Shapes
{
    std::vector<int64_t> q, k, qw, kw, cache;
};

Shapes goodShapes()
{
    return {{2, 16, 4, 128}, {2, 16, 4, 128}, {128}, {128}, {20, 128}};
}

// q, k, q_weight, k_weight, cos_sin_cache, q_out, k_out.
std::vector<PluginTensorDesc> descs(Shapes const& s, DataType t, DataType cacheType = DataType::kFLOAT)
{
    return {makeDesc(s.q, t), makeDesc(s.k, t), makeDesc(s.qw, t), makeDesc(s.kw, t), makeDesc(s.cache, cacheType),
        makeDesc(s.q, t), makeDesc(s.k, t)};
}

std::vector<DynamicPluginTensorDesc> dynDescs(Shapes const& s, DataType t)
{
    std::vector<DynamicPluginTensorDesc> out;
    for (auto const& d : descs(s, t))
    {
        DynamicPluginTensorDesc dd{};
        dd.desc = d;
        dd.min = d.dims;
        dd.opt = d.dims;
        dd.max = d.dims;
        out.push_back(dd);
    }
    return out;
}

// Dims no TensorRT produces: a rank outside [0, Dims::MAX_DIMS] on one tensor (IOIndex: 0-4 the
// inputs, 5-6 the outputs). Entry points must refuse them before reading (or printing) an extent.
struct BadRank
{
    char const* name;
    int32_t tensor;
    int32_t nbDims;
    std::vector<char const*> needles;
};

std::vector<BadRank> badRankCases()
{
    return {
        {"nb_dims_9", 0, 9, {"invalid rank", "nbDims = 9", "(q)"}},
        {"nb_dims_negative", 3, -1, {"invalid rank", "nbDims = -1", "(k_weight)"}},
        {"out_nb_dims_9", 5, 9, {"invalid rank", "nbDims = 9", "(q_out)"}},
    };
}

void setRank(Dims& d, int32_t nbDims)
{
    for (int32_t j = d.nbDims < 0 ? 0 : d.nbDims; j < Dims::MAX_DIMS; ++j)
    {
        d.d[j] = 1;
    }
    d.nbDims = nbDims;
}

// ---- creator: identity and field list --------------------------------------------------------

void testCreator(IPluginCreatorV3One* creator, Args const& args)
{
    check(std::string(creator->getPluginName()) == args.name, "creator.name", creator->getPluginName());
    check(std::string(creator->getPluginVersion()) == args.version, "creator.version", creator->getPluginVersion());
    check(std::string(creator->getPluginNamespace()) == args.ns, "creator.namespace", creator->getPluginNamespace());
    check(std::string(creator->getInterfaceInfo().kind) == "PLUGIN CREATOR_V3ONE", "creator.interface_kind",
        creator->getInterfaceInfo().kind);

    PluginFieldCollection const* names = creator->getFieldNames();
    check(names != nullptr, "creator.fields.present");
    if (names == nullptr)
    {
        return;
    }
    std::string got;
    std::vector<std::pair<std::string, std::string>> list;
    for (int32_t i = 0; i < names->nbFields; ++i)
    {
        PluginField const& f = names->fields[i];
        list.emplace_back(f.name, fieldTypeName(f.type));
        std::printf("FIELD %s %s %d\n", f.name, fieldTypeName(f.type), f.length);
        got += std::string(f.name) + ":" + fieldTypeName(f.type) + " ";
    }
    if (!args.fields.empty())
    {
        check(list == args.fields, "creator.fields.match_contract", "got " + got);
    }
}

// ---- create: the parser's field forms, string fields, defaults, wide types -------------------

void testCreate(IPluginCreatorV3One* c, Args const& args, RecordingLogger& logger)
{
    float const dEps = static_cast<float>(args.defaultOf("epsilon", 1e-6));
    int32_t const dIl = static_cast<int32_t>(args.defaultOf("interleaved", 1));
    int32_t const dR = static_cast<int32_t>(args.defaultOf("rounding", 0));

    // Exactly what the ONNX parser forwards. (It narrows INT (int64) to int32; our values are 0/1,
    // so narrowing is lossless.)
    Fields parsed = parserFields(1e-5F, 0, 1);
    PluginPtr p = create(c, &parsed);
    check(p != nullptr, "create.parser_fields", logger.lastSince(0));
    if (p)
    {
        check(serializedAttrs(p.get()).equals(1e-5F, 0, 1), "create.parser_fields.values", describe(p.get(), logger));
    }
    // Strings as the parser copies them (NUL counted), and without the NUL counted.
    for (bool countNul : {true, false})
    {
        Fields f = parserFields(1e-6F, 1, 0);
        f.str("plugin_version", args.version, countNul).str("plugin_namespace", args.ns, countNul);
        check(create(c, &f) != nullptr,
            std::string("create.string_fields.") + (countNul ? "nul_counted" : "nul_not_counted"), logger.lastSince(0));
    }
    // Missing fields -> defaults.
    struct Case
    {
        char const* name;
        Fields fields;
        bool nullCollection;
        float eps;
        int32_t interleaved;
        int32_t rounding;
    };
    Fields onlyEps;
    onlyEps.add("epsilon", 1e-3F, PluginFieldType::kFLOAT32);
    Fields onlyRounding;
    onlyRounding.add("rounding", int32_t{1}, PluginFieldType::kINT32);
    // Defensive widths: kINT64 ints, kFLOAT64 epsilon (Python/numpy callers).
    Fields wide;
    wide.add("epsilon", 1e-5, PluginFieldType::kFLOAT64);
    wide.add("interleaved", int64_t{0}, PluginFieldType::kINT64);
    wide.add("rounding", int64_t{1}, PluginFieldType::kINT64);
    std::vector<Case> cases = {
        {"create.defaults.null_collection", Fields{}, true, dEps, dIl, dR},
        {"create.defaults.empty_collection", Fields{}, false, dEps, dIl, dR},
        {"create.defaults.only_epsilon", onlyEps, false, 1e-3F, dIl, dR},
        {"create.defaults.only_rounding", onlyRounding, false, dEps, dIl, 1},
        {"create.wide_types", wide, false, 1e-5F, 0, 1},
    };
    for (Case& cs : cases)
    {
        PluginPtr q = create(c, cs.nullCollection ? nullptr : &cs.fields);
        check(q != nullptr && serializedAttrs(q.get()).equals(cs.eps, cs.interleaved, cs.rounding), cs.name,
            describe(q.get(), logger));
    }
}

// ---- bad_field: every bad field -> nullptr + one logged error naming the field ---------------

struct BadField
{
    char const* name;
    char const* mentions;
    Fields f;
};

std::vector<BadField> badFieldCases()
{
    auto one = [](char const* field, auto value, PluginFieldType type, int32_t length = 1) {
        Fields f;
        f.add(field, value, type, length);
        return f;
    };
    auto str = [](char const* field, char const* value) {
        Fields f;
        f.str(field, value);
        return f;
    };
    Fields nullData;
    nullData.raw("epsilon", std::vector<char>(4), PluginFieldType::kFLOAT32, 1, /*nullData=*/true);
    // A kCHAR whose length is negative: refused, not read as a huge size_t (the string would be
    // scanned past its end up to some NUL).
    Fields negativeLength;
    negativeLength.raw("plugin_version", {'1', '\0'}, PluginFieldType::kCHAR, -1);
    Fields duplicate;
    duplicate.add("rounding", int32_t{0}, PluginFieldType::kINT32).add("rounding", int32_t{1}, PluginFieldType::kINT32);
    using T = PluginFieldType;
    return {
        {"epsilon_zero", "epsilon", one("epsilon", 0.0F, T::kFLOAT32)},
        {"epsilon_negative", "epsilon", one("epsilon", -1e-6F, T::kFLOAT32)},
        {"epsilon_nan", "epsilon", one("epsilon", std::nanf(""), T::kFLOAT32)},
        {"epsilon_inf", "epsilon", one("epsilon", std::numeric_limits<float>::infinity(), T::kFLOAT32)},
        {"epsilon_f64_underflow", "epsilon", one("epsilon", 1e-300, T::kFLOAT64)}, // 0 in float32
        {"interleaved_2", "interleaved", one("interleaved", int32_t{2}, T::kINT32)},
        {"interleaved_negative", "interleaved", one("interleaved", int32_t{-1}, T::kINT32)},
        {"rounding_2", "rounding", one("rounding", int32_t{2}, T::kINT32)},
        {"rounding_negative", "rounding", one("rounding", int32_t{-1}, T::kINT32)},
        {"rounding_int64_out_of_range", "rounding", one("rounding", int64_t{1} << 32 | 1, T::kINT64)},
        {"epsilon_wrong_type_int32", "epsilon", one("epsilon", int32_t{1}, T::kINT32)},
        {"epsilon_wrong_type_char", "epsilon", str("epsilon", "1e-6")},
        {"interleaved_wrong_type_float", "interleaved", one("interleaved", 1.0F, T::kFLOAT32)},
        {"rounding_wrong_type_char", "rounding", str("rounding", "0")},
        {"epsilon_wrong_type_fp16", "epsilon", one("epsilon", 1e-6F, T::kFLOAT16)},
        {"interleaved_length_2", "interleaved", one("interleaved", int32_t{1}, T::kINT32, 2)},
        {"rounding_length_0", "rounding", one("rounding", int32_t{0}, T::kINT32, 0)},
        {"epsilon_null_data", "epsilon", nullData},
        {"unknown_field", "theta", one("theta", 10000.0F, T::kFLOAT32)},
        {"duplicate_field", "rounding", duplicate},
        {"plugin_version_mismatch", "plugin_version", str("plugin_version", "2")},
        {"plugin_namespace_mismatch", "plugin_namespace", str("plugin_namespace", "other")},
        {"plugin_version_wrong_type", "plugin_version", one("plugin_version", int32_t{1}, T::kINT32)},
        {"plugin_version_negative_length", "plugin_version", negativeLength},
    };
}

void testBadFields(IPluginCreatorV3One* c, RecordingLogger& logger)
{
    std::vector<BadField> bad = badFieldCases();
    for (TensorRTPhase phase : {TensorRTPhase::kBUILD, TensorRTPhase::kRUNTIME})
    {
        for (auto& b : bad)
        {
            size_t const mark = logger.mark();
            PluginPtr p = create(c, &b.f, phase, "bad_node");
            std::string const last = logger.lastSince(mark);
            bool const logged = logger.errorsSince(mark) == 1 && last.find(b.mentions) != std::string::npos
                && last.find("bad_node") != std::string::npos;
            std::string const n
                = std::string("bad_field.") + b.name + (phase == TensorRTPhase::kBUILD ? ".build" : ".runtime");
            check(p == nullptr && logged, n, std::string(p ? "a plugin was created" : "nullptr") + "; logged: " + last);
            if (phase == TensorRTPhase::kBUILD && p == nullptr)
            {
                std::printf("MESSAGE %s %s\n", b.name, last.c_str());
            }
        }
    }
    // A malformed collection (nbFields > 0, fields null).
    PluginFieldCollection fc{};
    fc.nbFields = 2;
    fc.fields = nullptr;
    size_t const mark = logger.mark();
    PluginPtr p(c->createPlugin("bad_node", &fc, TensorRTPhase::kBUILD));
    check(p == nullptr && logger.errorsSince(mark) == 1, "bad_field.malformed_collection", logger.lastSince(mark));
}

// ---- plugin: capabilities, names, outputs, timing-cache ID -----------------------------------

void testPluginCore(IPluginV3OneCore* core, IPluginV3OneBuild* build, IPluginV3OneRuntime* rt)
{
    check(std::string(core->getInterfaceInfo().kind) == "PLUGIN_V3ONE_CORE"
            && std::string(build->getInterfaceInfo().kind) == "PLUGIN_V3ONE_BUILD"
            && std::string(rt->getInterfaceInfo().kind) == "PLUGIN_V3ONE_RUNTIME",
        "plugin.capability_kinds");
    check(std::string(core->getPluginName()) == "QKNormRoPE" && std::string(core->getPluginVersion()) == "1"
            && std::string(core->getPluginNamespace()) == "qkrope",
        "plugin.core_names");
    check(build->getNbOutputs() == 2, "plugin.nb_outputs");
    char const* id = build->getTimingCacheID();
    check(id != nullptr && std::strstr(id, "rounding=0") != nullptr, "plugin.timing_cache_id", id ? id : "null");
}

// ---- shapes: getOutputShapes through a test IExprBuilder -------------------------------------

DimsExprs dimsExprs(std::vector<IDimensionExpr const*> const& v)
{
    DimsExprs d{};
    d.nbDims = static_cast<int32_t>(v.size());
    for (size_t i = 0; i < v.size(); ++i)
    {
        d.d[i] = v[i];
    }
    return d;
}

void testOutputShapes(IPluginV3OneBuild* build, RecordingLogger& logger)
{
    FakeExprBuilder eb;
    auto cst = [&](int64_t v) { return eb.constant(v); };
    IDimensionExpr const* B = eb.impl.symbol();
    IDimensionExpr const* S = eb.impl.symbol();
    IDimensionExpr const* R = eb.impl.symbol();
    IDimensionExpr const* H = cst(24);
    IDimensionExpr const* D = cst(128);
    DimsExprs out[2]{};
    auto run = [&](std::vector<DimsExprs> const& in) {
        size_t const mark = logger.mark();
        int32_t const rc = build->getOutputShapes(in.data(), static_cast<int32_t>(in.size()), nullptr, 0, out, 2, eb);
        return std::make_pair(rc, logger.lastSince(mark));
    };

    std::vector<DimsExprs> in = {dimsExprs({B, S, H, D}), dimsExprs({B, S, H, D}), dimsExprs({D}), dimsExprs({D}),
        dimsExprs({R, D})};
    auto r = run(in);
    bool same = r.first == 0;
    for (int32_t o = 0; same && o < 2; ++o)
    {
        same = out[o].nbDims == 4;
        for (int32_t j = 0; same && j < 4; ++j)
        {
            same = out[o].d[j] == in[o].d[j];
        }
    }
    check(same, "shapes.dynamic_equals_inputs", r.second);

    std::vector<DimsExprs> st = {dimsExprs({cst(1), cst(4608), H, D}), dimsExprs({cst(1), cst(4608), H, D}),
        dimsExprs({D}), dimsExprs({D}), dimsExprs({cst(4608), D})};
    r = run(st);
    check(r.first == 0 && out[0].d[1]->isConstant() && out[0].d[1]->getConstantValue() == 4608
            && out[1].d[3]->getConstantValue() == 128,
        "shapes.static_equals_inputs", r.second);

    struct BadShape
    {
        char const* name;
        std::vector<DimsExprs> in;
    };
    std::vector<BadShape> const badShapes = {
        {"weight_length", {in[0], in[1], dimsExprs({cst(64)}), in[3], in[4]}},
        {"rotary_odd", {in[0], in[1], in[2], in[3], dimsExprs({R, cst(127)})}},
        {"rotary_gt_head_dim", {in[0], in[1], in[2], in[3], dimsExprs({R, cst(256)})}},
        {"cache_overflow", {st[0], st[1], st[2], st[3], dimsExprs({cst(4000), D})}},
        {"q_rank", {dimsExprs({B, S, D}), in[1], in[2], in[3], in[4]}},
        {"cache_rank", {in[0], in[1], in[2], in[3], dimsExprs({D})}},
        {"qk_mismatch", {in[0], dimsExprs({B, S, cst(12), D}), in[2], in[3], in[4]}},
        {"head_dim_odd", {dimsExprs({B, S, H, cst(127)}), dimsExprs({B, S, H, cst(127)}), dimsExprs({cst(127)}),
                             dimsExprs({cst(127)}), dimsExprs({R, cst(126)})}},
    };
    for (auto const& b : badShapes)
    {
        auto rb = run(b.in);
        check(rb.first != 0 && rb.second != "<no message>", std::string("shapes.bad.") + b.name, rb.second);
    }
    std::vector<DimsExprs> rank9 = in;
    rank9[0].nbDims = 9;
    auto r9 = run(rank9);
    check(r9.first != 0 && missingFrom(r9.second, {"invalid rank", "nbDims = 9", "(q)"}).empty(),
        "shapes.bad.nb_dims_9", r9.second);
    std::vector<DimsExprs> four(in.begin(), in.begin() + 4);
    check(build->getOutputShapes(four.data(), 4, nullptr, 0, out, 2, eb) != 0, "shapes.bad.nb_inputs");
}

// ---- formats: the supportsFormatCombination matrix -------------------------------------------

void testFormats(IPluginV3OneBuild* build)
{
    std::vector<DataType> const all = {DataType::kFLOAT, DataType::kHALF, DataType::kBF16, DataType::kINT8,
        DataType::kINT32, DataType::kINT64, DataType::kBOOL};
    Shapes const s = goodShapes();
    bool ok = true;
    std::string detail;
    int32_t combos = 0;
    auto expectFalse = [&](int32_t pos, std::vector<DynamicPluginTensorDesc> const& d, std::string const& what) {
        if (build->supportsFormatCombination(pos, d.data(), 5, 2))
        {
            ok = false;
            detail += what + "; ";
        }
    };
    for (DataType qt : all)
    {
        bool const actSupported = qt == DataType::kFLOAT || qt == DataType::kHALF || qt == DataType::kBF16;
        bool const r0 = build->supportsFormatCombination(0, dynDescs(s, qt).data(), 5, 2);
        if (r0 != actSupported)
        {
            ok = false;
            detail += std::string("q ") + typeName(qt) + " -> " + (r0 ? "true" : "false") + "; ";
        }
        if (!actSupported)
        {
            continue;
        }
        for (int32_t pos = 1; pos < 7; ++pos)
        {
            for (DataType t : all)
            {
                auto dd = dynDescs(s, qt);
                dd[pos].desc.type = t;
                bool const expect = pos == 4 ? t == DataType::kFLOAT : t == qt;
                bool const got = build->supportsFormatCombination(pos, dd.data(), 5, 2);
                combos += got;
                if (got != expect)
                {
                    ok = false;
                    detail += std::string("q ") + typeName(qt) + " pos " + std::to_string(pos) + " " + typeName(t)
                        + " -> " + (got ? "true" : "false") + "; ";
                }
            }
            auto dd = dynDescs(s, qt);
            dd[pos].desc.format = TensorFormat::kHWC8;
            expectFalse(pos, dd, "non-linear format accepted at pos " + std::to_string(pos));
        }
        auto dd = dynDescs(s, qt);
        dd[0].desc.format = TensorFormat::kCHW32;
        expectFalse(0, dd, "non-linear q accepted");
    }
    check(ok, "formats.matrix", detail);
    check(combos == 3 * 6, "formats.count", std::to_string(combos) + " accepted (pos, type) pairs, expected 18");
    auto d = dynDescs(s, DataType::kHALF);
    check(!build->supportsFormatCombination(7, d.data(), 5, 2) && !build->supportsFormatCombination(-1, d.data(), 5, 2)
            && !build->supportsFormatCombination(0, d.data(), 4, 2),
        "formats.out_of_range");
}

// ---- dtypes: getOutputDataTypes ---------------------------------------------------------------

void testOutputDataTypes(IPluginV3OneBuild* build, RecordingLogger& logger)
{
    bool ok = true;
    std::string detail;
    for (DataType t : {DataType::kFLOAT, DataType::kHALF, DataType::kBF16})
    {
        DataType in[5] = {t, t, t, t, DataType::kFLOAT};
        DataType out[2] = {DataType::kINT8, DataType::kINT8};
        int32_t rc = build->getOutputDataTypes(out, 2, in, 5);
        if (rc != 0 || out[0] != t || out[1] != t)
        {
            ok = false;
            detail += std::string(typeName(t)) + " ";
        }
    }
    check(ok, "dtypes.same_as_inputs", detail);
    DataType mixed[5] = {DataType::kFLOAT, DataType::kHALF, DataType::kFLOAT, DataType::kFLOAT, DataType::kFLOAT};
    DataType out[2];
    size_t mark = logger.mark();
    check(build->getOutputDataTypes(out, 2, mixed, 5) != 0 && logger.errorsSince(mark) == 1, "dtypes.bad.q_k_mismatch",
        logger.lastSince(mark));
    DataType ints[5] = {DataType::kINT32, DataType::kINT32, DataType::kINT32, DataType::kINT32, DataType::kFLOAT};
    mark = logger.mark();
    check(build->getOutputDataTypes(out, 2, ints, 5) != 0 && logger.errorsSince(mark) == 1, "dtypes.bad.int32",
        logger.lastSince(mark));
    check(build->getOutputDataTypes(out, 1, ints, 5) != 0, "dtypes.bad.nb_outputs");
}

// ---- configure: configurePlugin (build time, dynamic and static shapes) ----------------------

void testConfigure(IPluginV3OneBuild* build, RecordingLogger& logger)
{
    Shapes dyn{{-1, -1, 24, 128}, {-1, -1, 24, 128}, {128}, {128}, {-1, 128}};
    auto in = dynDescs(dyn, DataType::kBF16);
    check(build->configurePlugin(in.data(), 5, in.data() + 5, 2) == 0, "configure.dynamic_ok", logger.lastSince(0));
    Shapes bad{{1, 4608, 24, 128}, {1, 4608, 24, 128}, {128}, {128}, {4096, 128}};
    auto inBad = dynDescs(bad, DataType::kBF16);
    size_t const mark = logger.mark();
    check(build->configurePlugin(inBad.data(), 5, inBad.data() + 5, 2) != 0
            && logger.lastSince(mark).find("overflow") != std::string::npos,
        "configure.static_cache_overflow", logger.lastSince(mark));
    for (BadRank const& b : badRankCases())
    {
        auto d = dynDescs(goodShapes(), DataType::kHALF);
        setRank(d[b.tensor].desc.dims, b.nbDims);
        size_t const at = logger.mark();
        int32_t const rc = build->configurePlugin(d.data(), 5, d.data() + 5, 2);
        checkRefusal(std::string("configure.bad.") + b.name, rc, 1, logger, at, b.needles);
    }
}

// ---- shape_change: onShapeChange (run time) ---------------------------------------------------

void testShapeChange(IPluginV3OneRuntime* rt, RecordingLogger& logger)
{
    auto ok = descs(goodShapes(), DataType::kHALF);
    check(rt->onShapeChange(ok.data(), 5, ok.data() + 5, 2) == 0, "shape_change.ok", logger.lastSince(0));
    Shapes s = goodShapes();
    s.cache = {15, 128};
    auto overflow = descs(s, DataType::kHALF);
    size_t const mark = logger.mark();
    check(rt->onShapeChange(overflow.data(), 5, overflow.data() + 5, 2) != 0
            && logger.lastSince(mark).find("required rows (seq_len) = 16, cache rows = 15, overflow = 1")
                != std::string::npos,
        "shape_change.cache_overflow", logger.lastSince(mark));
    for (BadRank const& b : badRankCases())
    {
        auto d = descs(goodShapes(), DataType::kHALF);
        setRank(d[b.tensor].dims, b.nbDims);
        size_t const at = logger.mark();
        int32_t const rc = rt->onShapeChange(d.data(), 5, d.data() + 5, 2);
        checkRefusal(std::string("shape_change.bad.") + b.name, rc, 1, logger, at, b.needles);
    }
}

// ---- enqueue: refuses malformed runtime shapes without touching memory -----------------------

// The pointers are distinct and non-null (small host buffers, never dereferenced by the plugin on
// the host): null pointers would make checkParams return kNULL_POINTER for every case and mask which
// check refused. Each case must get enqueue's own status and a message naming its cause.
void testEnqueue(IPluginV3OneRuntime* rt, RecordingLogger& logger)
{
    alignas(16) static unsigned char dummy[7][64];
    void const* inputs[5] = {dummy[0], dummy[1], dummy[2], dummy[3], dummy[4]};
    void* outputs[2] = {dummy[5], dummy[6]};
    void const* nullInputs[5] = {nullptr, nullptr, nullptr, nullptr, nullptr};
    void* nullOutputs[2] = {nullptr, nullptr};
    constexpr int32_t kBadShape = 2;    // qkrope::Status::kBAD_SHAPE (enqueue's own refusals)
    constexpr int32_t kNullPointer = 1; // qkrope::Status::kNULL_POINTER
    struct Case
    {
        char const* name;
        Shapes s;
        DataType cacheType;
        int32_t status;
        std::vector<char const*> needles; // all must occur in the logged message
        bool nullPointers;
    };
    Shapes const base = goodShapes();
    auto with = [&](std::vector<int64_t> Shapes::*member, std::vector<int64_t> v) {
        Shapes s = base;
        s.*member = std::move(v);
        return s;
    };
    std::vector<Case> const cases = {
        {"cache_overflow", with(&Shapes::cache, {15, 128}), DataType::kFLOAT, kBadShape,
            {"overflow", "required rows (seq_len) = 16, cache rows = 15", "nothing was executed"}, false},
        {"rotary_odd", with(&Shapes::cache, {20, 127}), DataType::kFLOAT, kBadShape,
            {"rotary_dim 127", "expected an even value", "nothing was executed"}, false},
        {"rotary_gt_head_dim", with(&Shapes::cache, {20, 130}), DataType::kFLOAT, kBadShape,
            {"rotary_dim 130", "head_dim = 128", "nothing was executed"}, false},
        {"weight_length", with(&Shapes::kw, {64}), DataType::kFLOAT, kBadShape,
            {"k_weight has length 64", "expected head_dim = 128", "nothing was executed"}, false},
        {"qk_mismatch", with(&Shapes::k, {2, 16, 8, 128}), DataType::kFLOAT, kBadShape,
            {"same shape", "nothing was executed"}, false},
        {"cache_not_fp32", base, DataType::kHALF, kBadShape,
            {"unsupported dtypes", "cache float16", "nothing was executed"}, false},
        {"null_pointers", base, DataType::kFLOAT, kNullPointer, {"null"}, true},
    };
    for (auto const& cs : cases)
    {
        auto d = descs(cs.s, DataType::kHALF, cs.cacheType);
        size_t const mark = logger.mark();
        int32_t const rc = rt->enqueue(d.data(), d.data() + 5, cs.nullPointers ? nullInputs : inputs,
            cs.nullPointers ? nullOutputs : outputs, nullptr, nullptr);
        checkRefusal(std::string("enqueue.refuses.") + cs.name, rc, cs.status, logger, mark, cs.needles);
    }
    for (BadRank const& b : badRankCases())
    {
        auto d = descs(base, DataType::kHALF);
        setRank(d[b.tensor].dims, b.nbDims);
        std::vector<char const*> needles = b.needles;
        needles.push_back("nothing was executed");
        size_t const mark = logger.mark();
        int32_t const rc = rt->enqueue(d.data(), d.data() + 5, inputs, outputs, nullptr, nullptr);
        checkRefusal(std::string("enqueue.refuses.") + b.name, rc, kBadShape, logger, mark, needles);
    }
    Shapes empty = base;
    empty.q = {0, 16, 4, 128};
    empty.k = {0, 16, 4, 128};
    auto d = descs(empty, DataType::kHALF);
    check(rt->enqueue(d.data(), d.data() + 5, nullInputs, nullOutputs, nullptr, nullptr) == 0,
        "enqueue.empty_batch_noop", logger.lastSince(0));
}

// ---- serialize: getFieldsToSerialize -> createPlugin(kRUNTIME) round trip --------------------

void testSerialize(IPluginCreatorV3One* c, RecordingLogger& logger)
{
    Fields f = parserFields(3e-5F, 0, 1);
    PluginPtr q = create(c, &f);
    if (q == nullptr)
    {
        check(false, "serialize.create", logger.lastSince(0));
        return;
    }
    PluginFieldCollection const* fc = runtimeOf(q.get())->getFieldsToSerialize();
    bool const typesOk = fc != nullptr && fc->nbFields == 3;
    for (int32_t i = 0; typesOk && i < 3; ++i)
    {
        std::printf("SERIALIZED %s %s %d\n", fc->fields[i].name, fieldTypeName(fc->fields[i].type),
            fc->fields[i].length);
    }
    check(typesOk, "serialize.fields", fc ? std::to_string(fc->nbFields) : "null");
    // Copy as TensorRT would into the plan (every serialised field is 4 bytes an element), then
    // recreate from the copy.
    Fields copy;
    for (int32_t i = 0; fc && i < fc->nbFields; ++i)
    {
        auto const* data = static_cast<char const*>(fc->fields[i].data);
        std::vector<char> bytes(data, data + 4 * static_cast<size_t>(fc->fields[i].length));
        copy.raw(fc->fields[i].name, bytes, fc->fields[i].type, fc->fields[i].length);
    }
    PluginPtr r = create(c, &copy, TensorRTPhase::kRUNTIME, "deserialized");
    check(r != nullptr && serializedAttrs(r.get()).equals(3e-5F, 0, 1), "serialize.roundtrip", describe(r.get(), logger));
}

// ---- clone: complete and independent ----------------------------------------------------------

void testClone(IPluginCreatorV3One* c, RecordingLogger& logger)
{
    Fields f = parserFields(3e-5F, 0, 1);
    PluginPtr q = create(c, &f);
    if (q == nullptr)
    {
        check(false, "clone.create", logger.lastSince(0));
        return;
    }
    PluginPtr cl(q->clone());
    check(cl != nullptr && cl != q && serializedAttrs(cl.get()).equals(3e-5F, 0, 1) && coreOf(cl.get()) != nullptr
            && buildOf(cl.get()) != nullptr && runtimeOf(cl.get()) != nullptr,
        "clone.complete", cl ? serializedAttrs(cl.get()).str() : "null");
    // The clone's serialized fields must point into the clone, not into q.
    PluginFieldCollection const* fq = runtimeOf(q.get())->getFieldsToSerialize();
    PluginFieldCollection const* fcl = cl ? runtimeOf(cl.get())->getFieldsToSerialize() : nullptr;
    check(fcl != nullptr && fq != nullptr && fcl->fields[0].data != fq->fields[0].data, "clone.independent");
    q.reset(); // the clone must outlive its source
    check(cl != nullptr && serializedAttrs(cl.get()).equals(3e-5F, 0, 1), "clone.outlives_source");
}

// ---- attach_to_context: a complete clone --------------------------------------------------------

void testAttachToContext(IPluginCreatorV3One* c, RecordingLogger& logger)
{
    Fields f = parserFields(3e-5F, 0, 1);
    PluginPtr q = create(c, &f);
    if (q == nullptr)
    {
        check(false, "attach_to_context.create", logger.lastSince(0));
        return;
    }
    PluginPtr att(runtimeOf(q.get())->attachToContext(nullptr));
    bool const distinct = att != q;
    q.reset(); // the attached plugin must outlive its source
    check(att != nullptr && distinct && serializedAttrs(att.get()).equals(3e-5F, 0, 1) && buildOf(att.get()) != nullptr,
        "attach_to_context.complete");
}

// Every capability of a plugin created from the parser's fields.
void testPlugin(IPluginCreatorV3One* c, RecordingLogger& logger)
{
    Fields f = parserFields(1e-6F, 1, 0);
    PluginPtr p = create(c, &f);
    if (p == nullptr)
    {
        check(false, "plugin.create", logger.lastSince(0));
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

int main(int argc, char** argv)
{
    Args args;
    if (int rc = parseArgs(argc, argv, args))
    {
        return rc;
    }
    testVcLibrary(args);              // first: no library has registered anything yet
    testSelfRegisteringLibrary(args); // its static initialiser calls getPluginRegistry() on dlopen
    std::printf("SUMMARY passed=%d failed=%d\n", gPassed, gFailed);
    // Libraries are left loaded: static destructors run at exit in the usual order.
    return gFailed == 0 ? 0 : 1;
}
