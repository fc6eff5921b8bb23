// qkrope: host-side contract test of the QKNormRoPE TensorRT plugin. Needs neither a GPU nor
// libnvinfer: it dlopens the plugin libraries and drives the IPluginV3 interfaces the way
// TensorRT and its ONNX parser do. Driven by tests/test_plugin_host.py.
//
// Usage: qkrope_plugin_host_test --vc <libqkrope_vc_plugin.so> --plugin <libqkrope_plugin.so>
//            [--expect-name N] [--expect-version V] [--expect-namespace NS]
//            [--expect-field name:kTYPE]... [--default name=value]...
// Output: one line per check, "PASS <check>" or "FAIL <check>: <detail>"; "FIELD <name> <type>"
// for each creator field; "SUMMARY passed=<n> failed=<m>" last. Exit status 0 iff nothing failed.
#include <NvInferRuntime.h>

#include <dlfcn.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <vector>

using namespace nvinfer1;

namespace
{

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

char const* fieldTypeName(PluginFieldType t)
{
    switch (t)
    {
    case PluginFieldType::kFLOAT16: return "kFLOAT16";
    case PluginFieldType::kFLOAT32: return "kFLOAT32";
    case PluginFieldType::kFLOAT64: return "kFLOAT64";
    case PluginFieldType::kINT8: return "kINT8";
    case PluginFieldType::kINT16: return "kINT16";
    case PluginFieldType::kINT32: return "kINT32";
    case PluginFieldType::kCHAR: return "kCHAR";
    case PluginFieldType::kDIMS: return "kDIMS";
    case PluginFieldType::kUNKNOWN: return "kUNKNOWN";
    case PluginFieldType::kBF16: return "kBF16";
    case PluginFieldType::kINT64: return "kINT64";
    default: break;
    }
    return "other";
}

// ---- loggers ---------------------------------------------------------------------------------

struct RecordingLogger : ILogger
{
    std::vector<std::pair<Severity, std::string>> messages;
    void log(Severity severity, AsciiChar const* msg) noexcept override
    {
        messages.emplace_back(severity, msg ? msg : "");
    }
    size_t errorsSince(size_t mark) const
    {
        size_t n = 0;
        for (size_t i = mark; i < messages.size(); ++i)
        {
            n += messages[i].first <= Severity::kERROR;
        }
        return n;
    }
    std::string lastSince(size_t mark) const
    {
        return messages.size() > mark ? messages.back().second : std::string("<no message>");
    }
};

RecordingLogger gFinderLogger; // reached through setLoggerFinder (VC library)
RecordingLogger gGlobalLogger; // reached through the fake getLogger() below

struct TestLoggerFinder : ILoggerFinder
{
    ILogger* findLogger() override
    {
        return &gFinderLogger;
    }
};
TestLoggerFinder gFinder;

// ---- a fake plugin registry, found by libqkrope_plugin.so through dlsym --------------------

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
class FakeRegistry : public IPluginRegistry
{
public:
    struct Entry
    {
        IPluginCreatorInterface* creator;
        std::string ns;
    };
    std::vector<Entry> entries;

#if NV_TENSORRT_MAJOR < 11
    bool registerCreator(IPluginCreator&, AsciiChar const* const) noexcept override
    {
        return false;
    }
    IPluginCreator* const* getPluginCreatorList(int32_t* const n) const noexcept override
    {
        *n = 0;
        return nullptr;
    }
    IPluginCreator* getPluginCreator(AsciiChar const* const, AsciiChar const* const, AsciiChar const* const) noexcept override
    {
        return nullptr;
    }
    bool deregisterCreator(IPluginCreator const&) noexcept override
    {
        return false;
    }
#endif
    void setErrorRecorder(IErrorRecorder* const) noexcept override {}
    IErrorRecorder* getErrorRecorder() const noexcept override
    {
        return nullptr;
    }
    bool isParentSearchEnabled() const override
    {
        return false;
    }
    void setParentSearchEnabled(bool const) override {}
    PluginLibraryHandle loadLibrary(AsciiChar const*) noexcept override
    {
        return nullptr;
    }
    void deregisterLibrary(PluginLibraryHandle) noexcept override {}
    bool registerCreator(IPluginCreatorInterface& creator, AsciiChar const* const ns) noexcept override
    {
        entries.push_back({&creator, ns ? ns : "<null>"});
        return true;
    }
    IPluginCreatorInterface* const* getAllCreators(int32_t* const n) const noexcept override
    {
        *n = 0;
        return nullptr;
    }
    IPluginCreatorInterface* getCreator(AsciiChar const* const, AsciiChar const* const, AsciiChar const* const) noexcept override
    {
        return nullptr;
    }
    bool deregisterCreator(IPluginCreatorInterface const&) noexcept override
    {
        return false;
    }
    IPluginResource* acquirePluginResource(AsciiChar const*, IPluginResource*) noexcept override
    {
        return nullptr;
    }
    int32_t releasePluginResource(AsciiChar const*) noexcept override
    {
        return 0;
    }
    IPluginCreatorInterface* const* getAllCreatorsRecursive(int32_t* const n) noexcept override
    {
        *n = 0;
        return nullptr;
    }
};
#pragma GCC diagnostic pop

FakeRegistry gRegistry;
int gRegistryCalls = 0;

} // namespace

// Exported from this executable (-rdynamic) under TensorRT's names.
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

// ---- a test IExprBuilder (TensorRT 10+ pimpl pattern: the public classes forward to apiv::V*) ----

class FakeDimImpl : public apiv::VDimensionExpr
{
public:
    FakeDimImpl(int64_t v, bool c)
        : mValue(v)
        , mConstant(c)
    {
    }
    bool isConstant() const override
    {
        return mConstant;
    }
    int64_t getConstantValue() const override
    {
        return mConstant ? mValue : std::numeric_limits<int64_t>::min();
    }
    bool isSizeTensor() const override
    {
        return false;
    }

private:
    int64_t mValue;
    bool mConstant;
};

class FakeDim : public IDimensionExpr
{
public:
    FakeDim(int64_t v, bool c)
        : mStorage(v, c)
    {
        mImpl = &mStorage;
    }
    ~FakeDim() noexcept override = default;

private:
    FakeDimImpl mStorage;
};

class FakeBuilderImpl : public apiv::VExprBuilder
{
public:
    IDimensionExpr const* constant(int64_t value) override
    {
        mDims.emplace_back(std::make_unique<FakeDim>(value, true));
        return mDims.back().get();
    }
    IDimensionExpr const* symbol()
    {
        mDims.emplace_back(std::make_unique<FakeDim>(0, false));
        return mDims.back().get();
    }
    IDimensionExpr const* operation(DimensionOperation op, IDimensionExpr const& a, IDimensionExpr const& b) override
    {
        ++operations;
        if (!a.isConstant() || !b.isConstant())
        {
            return symbol();
        }
        int64_t const x = a.getConstantValue();
        int64_t const y = b.getConstantValue();
        switch (op)
        {
        case DimensionOperation::kSUM: return constant(x + y);
        case DimensionOperation::kPROD: return constant(x * y);
        case DimensionOperation::kMAX: return constant(x > y ? x : y);
        case DimensionOperation::kMIN: return constant(x < y ? x : y);
        case DimensionOperation::kSUB: return constant(x - y);
        case DimensionOperation::kEQUAL: return constant(x == y);
        case DimensionOperation::kLESS: return constant(x < y);
        default: return symbol();
        }
    }
    IDimensionExpr const* declareSizeTensor(int32_t, IDimensionExpr const&, IDimensionExpr const&) override
    {
        return symbol();
    }
    int operations{0};

private:
    std::deque<std::unique_ptr<FakeDim>> mDims;
};

class FakeExprBuilder : public IExprBuilder
{
public:
    FakeExprBuilder()
    {
        mImpl = &impl;
    }
    ~FakeExprBuilder() noexcept override = default;
    FakeBuilderImpl impl;
};

// ---- helpers -------------------------------------------------------------------------------

struct Args
{
    std::string vc;
    std::string plugin;
    std::string name{"QKNormRoPE"};
    std::string version{"1"};
    std::string ns{"qkrope"};
    std::vector<std::pair<std::string, std::string>> fields; // name, type
    std::map<std::string, double> defaults;
};

// Owns the storage of a PluginFieldCollection built field by field (the parser's layout). Copyable:
// the PluginField array is rebuilt by get() so it always points into this object.
struct Fields
{
    struct Entry
    {
        std::string name;
        std::vector<char> bytes;
        PluginFieldType type;
        int32_t length;
        bool nullData;
    };
    std::vector<Entry> entries;
    std::vector<PluginField> list;
    PluginFieldCollection fc{};

    template <typename T>
    Fields& add(char const* name, T value, PluginFieldType type, int32_t length = 1)
    {
        std::vector<char> bytes(sizeof(T) * (length > 0 ? static_cast<size_t>(length) : 1));
        for (size_t off = 0; off + sizeof(T) <= bytes.size(); off += sizeof(T))
        {
            std::memcpy(bytes.data() + off, &value, sizeof(T));
        }
        return raw(name, std::move(bytes), type, length);
    }
    // kCHAR the way onnx-tensorrt copies a STRING attribute: characters + NUL, length counts the NUL.
    Fields& str(char const* name, std::string const& s, bool countNul = true)
    {
        std::vector<char> bytes(s.begin(), s.end());
        bytes.push_back('\0');
        return raw(name, std::move(bytes), PluginFieldType::kCHAR,
            static_cast<int32_t>(s.size() + (countNul ? 1 : 0)));
    }
    Fields& raw(char const* name, std::vector<char> bytes, PluginFieldType type, int32_t length, bool nullData = false)
    {
        entries.push_back({name, std::move(bytes), type, length, nullData});
        return *this;
    }
    PluginFieldCollection const* get()
    {
        list.clear();
        for (Entry& e : entries)
        {
            list.emplace_back(e.name.c_str(), e.nullData ? nullptr : e.bytes.data(), e.type, e.length);
        }
        fc.nbFields = static_cast<int32_t>(list.size());
        fc.fields = list.data();
        return &fc;
    }
};

// The fields the ONNX parser forwards for a node exported by qkrope (FLOAT -> kFLOAT32, INT ->
// kINT32 narrowed from int64; plugin_version/plugin_namespace are not creator fields, so the parser
// does not forward them).
Fields parserFields(float eps, int64_t interleaved, int64_t rounding)
{
    Fields f;
    f.add("epsilon", eps, PluginFieldType::kFLOAT32);
    f.add("interleaved", static_cast<int32_t>(interleaved), PluginFieldType::kINT32);
    f.add("rounding", static_cast<int32_t>(rounding), PluginFieldType::kINT32);
    return f;
}

struct Attrs
{
    float eps{std::nanf("")};
    int32_t interleaved{-99};
    int32_t rounding{-99};
    std::string error;
};

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

std::string attrsString(Attrs const& a)
{
    char buf[160];
    std::snprintf(buf, sizeof(buf), "epsilon=%.9g interleaved=%d rounding=%d %s", static_cast<double>(a.eps),
        a.interleaved, a.rounding, a.error.c_str());
    return buf;
}

bool attrsEqual(Attrs const& a, float eps, int32_t il, int32_t r)
{
    return a.error.empty() && a.eps == eps && a.interleaved == il && a.rounding == r;
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

// ---- the checks ----------------------------------------------------------------------------

using GetCreatorsFn = IPluginCreatorInterface* const* (*) (int32_t&);
using SetLoggerFinderFn = void (*)(ILoggerFinder*);

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
        list.emplace_back(names->fields[i].name, fieldTypeName(names->fields[i].type));
        std::printf("FIELD %s %s %d\n", names->fields[i].name, fieldTypeName(names->fields[i].type),
            names->fields[i].length);
        got += std::string(names->fields[i].name) + ":" + fieldTypeName(names->fields[i].type) + " ";
    }
    if (!args.fields.empty())
    {
        check(list == args.fields, "creator.fields.match_contract", "got " + got);
    }
}

IPluginV3* create(IPluginCreatorV3One* c, Fields* f, TensorRTPhase phase = TensorRTPhase::kBUILD,
    char const* name = "test_node")
{
    return c->createPlugin(name, f ? f->get() : nullptr, phase);
}

void testCreate(IPluginCreatorV3One* c, Args const& args, RecordingLogger& logger)
{
    float const dEps = static_cast<float>(args.defaults.count("epsilon") ? args.defaults.at("epsilon") : 1e-6);
    int32_t const dIl = static_cast<int32_t>(args.defaults.count("interleaved") ? args.defaults.at("interleaved") : 1);
    int32_t const dR = static_cast<int32_t>(args.defaults.count("rounding") ? args.defaults.at("rounding") : 0);

    // Exactly what the ONNX parser forwards.
    {
        Fields f = parserFields(1e-5F, 0, 1);
        IPluginV3* p = create(c, &f);
        check(p != nullptr, "create.parser_fields", logger.lastSince(0));
        if (p)
        {
            Attrs a = serializedAttrs(p);
            check(attrsEqual(a, 1e-5F, 0, 1), "create.parser_fields.values", attrsString(a));
            delete p;
        }
    }
    // The parser narrows INT (int64) to int32; a large int64 attribute therefore arrives truncated.
    // Our values are 0/1 so narrowing is lossless.
    // Strings as the parser copies them (NUL counted), and without the NUL counted.
    for (bool countNul : {true, false})
    {
        Fields f = parserFields(1e-6F, 1, 0);
        f.str("plugin_version", args.version, countNul).str("plugin_namespace", args.ns, countNul);
        IPluginV3* p = create(c, &f);
        std::string const n = std::string("create.string_fields.") + (countNul ? "nul_counted" : "nul_not_counted");
        check(p != nullptr, n, logger.lastSince(0));
        delete p;
    }
    // Missing fields -> defaults.
    {
        IPluginV3* p = create(c, nullptr);
        check(p != nullptr && attrsEqual(serializedAttrs(p), dEps, dIl, dR), "create.defaults.null_collection",
            p ? attrsString(serializedAttrs(p)) : logger.lastSince(0));
        delete p;
        Fields empty;
        p = create(c, &empty);
        check(p != nullptr && attrsEqual(serializedAttrs(p), dEps, dIl, dR), "create.defaults.empty_collection",
            p ? attrsString(serializedAttrs(p)) : logger.lastSince(0));
        delete p;
        Fields onlyEps;
        onlyEps.add("epsilon", 1e-3F, PluginFieldType::kFLOAT32);
        p = create(c, &onlyEps);
        check(p != nullptr && attrsEqual(serializedAttrs(p), 1e-3F, dIl, dR), "create.defaults.only_epsilon",
            p ? attrsString(serializedAttrs(p)) : logger.lastSince(0));
        delete p;
        Fields onlyRounding;
        onlyRounding.add("rounding", int32_t{1}, PluginFieldType::kINT32);
        p = create(c, &onlyRounding);
        check(p != nullptr && attrsEqual(serializedAttrs(p), dEps, dIl, 1), "create.defaults.only_rounding",
            p ? attrsString(serializedAttrs(p)) : logger.lastSince(0));
        delete p;
    }
    // Defensive widths: kINT64 ints, kFLOAT64 epsilon.
    {
        Fields f;
        f.add("epsilon", 1e-5, PluginFieldType::kFLOAT64);
        f.add("interleaved", int64_t{0}, PluginFieldType::kINT64);
        f.add("rounding", int64_t{1}, PluginFieldType::kINT64);
        IPluginV3* p = create(c, &f);
        check(p != nullptr && attrsEqual(serializedAttrs(p), 1e-5F, 0, 1), "create.wide_types",
            p ? attrsString(serializedAttrs(p)) : logger.lastSince(0));
        delete p;
    }

    // Every bad field: nullptr + one logged error naming the field.
    struct Bad
    {
        char const* name;
        char const* mentions;
        Fields f;
    };
    std::vector<Bad> bad;
    auto withEps = [](float v) {
        Fields f;
        f.add("epsilon", v, PluginFieldType::kFLOAT32);
        return f;
    };
    auto withInt = [](char const* n, int32_t v) {
        Fields f;
        f.add(n, v, PluginFieldType::kINT32);
        return f;
    };
    bad.push_back({"epsilon_zero", "epsilon", withEps(0.0F)});
    bad.push_back({"epsilon_negative", "epsilon", withEps(-1e-6F)});
    bad.push_back({"epsilon_nan", "epsilon", withEps(std::nanf(""))});
    bad.push_back({"epsilon_inf", "epsilon", withEps(std::numeric_limits<float>::infinity())});
    {
        Fields f;
        f.add("epsilon", 1e-300, PluginFieldType::kFLOAT64); // underflows to 0 in float32
        bad.push_back({"epsilon_f64_underflow", "epsilon", f});
    }
    bad.push_back({"interleaved_2", "interleaved", withInt("interleaved", 2)});
    bad.push_back({"interleaved_negative", "interleaved", withInt("interleaved", -1)});
    bad.push_back({"rounding_2", "rounding", withInt("rounding", 2)});
    bad.push_back({"rounding_negative", "rounding", withInt("rounding", -1)});
    {
        Fields f;
        f.add("rounding", int64_t{1} << 32 | 1, PluginFieldType::kINT64);
        bad.push_back({"rounding_int64_out_of_range", "rounding", f});
    }
    {
        Fields f;
        f.add("epsilon", int32_t{1}, PluginFieldType::kINT32);
        bad.push_back({"epsilon_wrong_type_int32", "epsilon", f});
    }
    {
        Fields f;
        f.str("epsilon", "1e-6");
        bad.push_back({"epsilon_wrong_type_char", "epsilon", f});
    }
    {
        Fields f;
        f.add("interleaved", 1.0F, PluginFieldType::kFLOAT32);
        bad.push_back({"interleaved_wrong_type_float", "interleaved", f});
    }
    {
        Fields f;
        f.str("rounding", "0");
        bad.push_back({"rounding_wrong_type_char", "rounding", f});
    }
    {
        Fields f;
        f.add("epsilon", 1e-6F, PluginFieldType::kFLOAT16);
        bad.push_back({"epsilon_wrong_type_fp16", "epsilon", f});
    }
    {
        Fields f;
        f.add("interleaved", int32_t{1}, PluginFieldType::kINT32, 2);
        bad.push_back({"interleaved_length_2", "interleaved", f});
    }
    {
        Fields f;
        f.add("rounding", int32_t{0}, PluginFieldType::kINT32, 0);
        bad.push_back({"rounding_length_0", "rounding", f});
    }
    {
        Fields f;
        f.raw("epsilon", std::vector<char>(4), PluginFieldType::kFLOAT32, 1, /*nullData=*/true);
        bad.push_back({"epsilon_null_data", "epsilon", f});
    }
    {
        Fields f;
        f.add("theta", 10000.0F, PluginFieldType::kFLOAT32);
        bad.push_back({"unknown_field", "theta", f});
    }
    {
        Fields f;
        f.add("rounding", int32_t{0}, PluginFieldType::kINT32).add("rounding", int32_t{1}, PluginFieldType::kINT32);
        bad.push_back({"duplicate_field", "rounding", f});
    }
    {
        Fields f;
        f.str("plugin_version", "2");
        bad.push_back({"plugin_version_mismatch", "plugin_version", f});
    }
    {
        Fields f;
        f.str("plugin_namespace", "other");
        bad.push_back({"plugin_namespace_mismatch", "plugin_namespace", f});
    }
    {
        Fields f;
        f.add("plugin_version", int32_t{1}, PluginFieldType::kINT32);
        bad.push_back({"plugin_version_wrong_type", "plugin_version", f});
    }
    for (TensorRTPhase phase : {TensorRTPhase::kBUILD, TensorRTPhase::kRUNTIME})
    {
        for (auto& b : bad)
        {
            size_t const mark = logger.messages.size();
            IPluginV3* p = create(c, &b.f, phase, "bad_node");
            std::string const last = logger.lastSince(mark);
            bool const logged = logger.errorsSince(mark) == 1 && last.find(b.mentions) != std::string::npos
                && last.find("bad_node") != std::string::npos;
            std::string const n = std::string("bad_field.") + b.name
                + (phase == TensorRTPhase::kBUILD ? ".build" : ".runtime");
            check(p == nullptr && logged, n,
                std::string(p ? "a plugin was created" : "nullptr") + "; logged: " + last);
            if (phase == TensorRTPhase::kBUILD && p == nullptr)
            {
                std::printf("MESSAGE %s %s\n", b.name, last.c_str());
            }
            delete p;
        }
    }
    {
        // A malformed collection (nbFields > 0, fields null).
        PluginFieldCollection fc{};
        fc.nbFields = 2;
        fc.fields = nullptr;
        size_t const mark = logger.messages.size();
        IPluginV3* p = c->createPlugin("bad_node", &fc, TensorRTPhase::kBUILD);
        check(p == nullptr && logger.errorsSince(mark) == 1, "bad_field.malformed_collection", logger.lastSince(mark));
        delete p;
    }
}

void testPlugin(IPluginCreatorV3One* c, RecordingLogger& logger)
{
    Fields f = parserFields(1e-6F, 1, 0);
    IPluginV3* p = create(c, &f);
    if (p == nullptr)
    {
        check(false, "plugin.create", logger.lastSince(0));
        return;
    }
    IPluginV3OneCore* core = coreOf(p);
    IPluginV3OneBuild* build = buildOf(p);
    IPluginV3OneRuntime* rt = runtimeOf(p);
    check(core && build && rt, "plugin.capabilities");
    if (!(core && build && rt))
    {
        delete p;
        return;
    }
    check(std::string(core->getInterfaceInfo().kind) == "PLUGIN_V3ONE_CORE"
            && std::string(build->getInterfaceInfo().kind) == "PLUGIN_V3ONE_BUILD"
            && std::string(rt->getInterfaceInfo().kind) == "PLUGIN_V3ONE_RUNTIME",
        "plugin.capability_kinds");
    check(std::string(core->getPluginName()) == "QKNormRoPE" && std::string(core->getPluginVersion()) == "1"
            && std::string(core->getPluginNamespace()) == "qkrope",
        "plugin.core_names");
    check(build->getNbOutputs() == 2, "plugin.nb_outputs");
    check(build->getTimingCacheID() != nullptr && std::strstr(build->getTimingCacheID(), "rounding=0") != nullptr,
        "plugin.timing_cache_id", build->getTimingCacheID() ? build->getTimingCacheID() : "null");

    // ---- getOutputShapes through a test IExprBuilder.
    {
        FakeExprBuilder eb;
        auto sym = [&]() { return eb.impl.symbol(); };
        auto cst = [&](int64_t v) { return eb.constant(v); };
        auto dimsExprs = [](std::vector<IDimensionExpr const*> const& v) {
            DimsExprs d{};
            d.nbDims = static_cast<int32_t>(v.size());
            for (size_t i = 0; i < v.size(); ++i)
            {
                d.d[i] = v[i];
            }
            return d;
        };
        IDimensionExpr const* B = sym();
        IDimensionExpr const* S = sym();
        IDimensionExpr const* R = sym();
        IDimensionExpr const* H = cst(24);
        IDimensionExpr const* D = cst(128);
        auto run = [&](std::vector<DimsExprs> const& in, DimsExprs* out) {
            size_t const mark = logger.messages.size();
            int32_t const rc = build->getOutputShapes(in.data(), static_cast<int32_t>(in.size()), nullptr, 0, out, 2, eb);
            return std::make_pair(rc, logger.lastSince(mark));
        };
        std::vector<DimsExprs> in = {dimsExprs({B, S, H, D}), dimsExprs({B, S, H, D}), dimsExprs({D}), dimsExprs({D}),
            dimsExprs({R, D})};
        DimsExprs out[2]{};
        auto r = run(in, out);
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
        r = run(st, out);
        check(r.first == 0 && out[0].d[1]->isConstant() && out[0].d[1]->getConstantValue() == 4608
                && out[1].d[3]->getConstantValue() == 128,
            "shapes.static_equals_inputs", r.second);

        struct BadShape
        {
            char const* name;
            std::vector<DimsExprs> in;
        };
        std::vector<BadShape> badShapes = {
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
            auto rb = run(b.in, out);
            check(rb.first != 0 && rb.second != "<no message>", std::string("shapes.bad.") + b.name, rb.second);
        }
        std::vector<DimsExprs> four(in.begin(), in.begin() + 4);
        check(build->getOutputShapes(four.data(), 4, nullptr, 0, out, 2, eb) != 0, "shapes.bad.nb_inputs");
    }

    // ---- supportsFormatCombination matrix.
    {
        std::vector<DataType> const all = {DataType::kFLOAT, DataType::kHALF, DataType::kBF16, DataType::kINT8,
            DataType::kINT32, DataType::kINT64, DataType::kBOOL};
        Shapes s = goodShapes();
        bool ok = true;
        std::string detail;
        int32_t combos = 0;
        for (DataType qt : all)
        {
            bool const actSupported = qt == DataType::kFLOAT || qt == DataType::kHALF || qt == DataType::kBF16;
            auto d = dynDescs(s, qt);
            bool const r0 = build->supportsFormatCombination(0, d.data(), 5, 2);
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
                if (build->supportsFormatCombination(pos, dd.data(), 5, 2))
                {
                    ok = false;
                    detail += "non-linear format accepted at pos " + std::to_string(pos) + "; ";
                }
            }
            auto dd = dynDescs(s, qt);
            dd[0].desc.format = TensorFormat::kCHW32;
            if (build->supportsFormatCombination(0, dd.data(), 5, 2))
            {
                ok = false;
                detail += "non-linear q accepted; ";
            }
        }
        check(ok, "formats.matrix", detail);
        check(combos == 3 * 6, "formats.count", std::to_string(combos) + " accepted (pos, type) pairs, expected 18");
        auto d = dynDescs(s, DataType::kHALF);
        check(!build->supportsFormatCombination(7, d.data(), 5, 2) && !build->supportsFormatCombination(-1, d.data(), 5, 2)
                && !build->supportsFormatCombination(0, d.data(), 4, 2),
            "formats.out_of_range");
    }

    // ---- getOutputDataTypes.
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
        size_t mark = logger.messages.size();
        check(build->getOutputDataTypes(out, 2, mixed, 5) != 0 && logger.errorsSince(mark) == 1, "dtypes.bad.q_k_mismatch",
            logger.lastSince(mark));
        DataType ints[5] = {DataType::kINT32, DataType::kINT32, DataType::kINT32, DataType::kINT32, DataType::kFLOAT};
        mark = logger.messages.size();
        check(build->getOutputDataTypes(out, 2, ints, 5) != 0 && logger.errorsSince(mark) == 1, "dtypes.bad.int32",
            logger.lastSince(mark));
        check(build->getOutputDataTypes(out, 1, ints, 5) != 0, "dtypes.bad.nb_outputs");
    }

    // ---- configurePlugin (build time, possibly dynamic) and onShapeChange (run time).
    {
        Shapes dyn{{-1, -1, 24, 128}, {-1, -1, 24, 128}, {128}, {128}, {-1, 128}};
        auto in = dynDescs(dyn, DataType::kBF16);
        check(build->configurePlugin(in.data(), 5, in.data() + 5, 2) == 0, "configure.dynamic_ok", logger.lastSince(0));
        Shapes bad{{1, 4608, 24, 128}, {1, 4608, 24, 128}, {128}, {128}, {4096, 128}};
        auto inBad = dynDescs(bad, DataType::kBF16);
        size_t mark = logger.messages.size();
        check(build->configurePlugin(inBad.data(), 5, inBad.data() + 5, 2) != 0
                && logger.lastSince(mark).find("overflow") != std::string::npos,
            "configure.static_cache_overflow", logger.lastSince(mark));

        auto ok = descs(goodShapes(), DataType::kHALF);
        check(rt->onShapeChange(ok.data(), 5, ok.data() + 5, 2) == 0, "shape_change.ok", logger.lastSince(0));
        Shapes s = goodShapes();
        s.cache = {15, 128};
        auto overflow = descs(s, DataType::kHALF);
        mark = logger.messages.size();
        check(rt->onShapeChange(overflow.data(), 5, overflow.data() + 5, 2) != 0
                && logger.lastSince(mark).find("required rows (seq_len) = 16, cache rows = 15, overflow = 1")
                    != std::string::npos,
            "shape_change.cache_overflow", logger.lastSince(mark));
    }

    // ---- enqueue refuses malformed runtime shapes before touching memory. The pointers are
    //      distinct and non-null (small host buffers, never dereferenced by the plugin on the host):
    //      null pointers would make checkParams return kNULL_POINTER for every case and mask which
    //      check refused. Each case must get enqueue's own status and a message naming its cause.
    {
        alignas(16) static unsigned char dummy[7][64];
        void const* inputs[5] = {dummy[0], dummy[1], dummy[2], dummy[3], dummy[4]};
        void* outputs[2] = {dummy[5], dummy[6]};
        void const* nullInputs[5] = {nullptr, nullptr, nullptr, nullptr, nullptr};
        void* nullOutputs[2] = {nullptr, nullptr};
        constexpr int32_t kBadShape = 2;   // qkrope::Status::kBAD_SHAPE (enqueue's own refusals)
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
        Shapes base = goodShapes();
        std::vector<Case> cases;
        Shapes s = base;
        s.cache = {15, 128};
        cases.push_back({"cache_overflow", s, DataType::kFLOAT, kBadShape,
            {"overflow", "required rows (seq_len) = 16, cache rows = 15", "nothing was executed"}, false});
        s = base;
        s.cache = {20, 127};
        cases.push_back({"rotary_odd", s, DataType::kFLOAT, kBadShape,
            {"rotary_dim 127", "expected an even value", "nothing was executed"}, false});
        s = base;
        s.cache = {20, 130};
        cases.push_back({"rotary_gt_head_dim", s, DataType::kFLOAT, kBadShape,
            {"rotary_dim 130", "head_dim = 128", "nothing was executed"}, false});
        s = base;
        s.kw = {64};
        cases.push_back({"weight_length", s, DataType::kFLOAT, kBadShape,
            {"k_weight has length 64", "expected head_dim = 128", "nothing was executed"}, false});
        s = base;
        s.k = {2, 16, 8, 128};
        cases.push_back({"qk_mismatch", s, DataType::kFLOAT, kBadShape, {"same shape", "nothing was executed"}, false});
        cases.push_back({"cache_not_fp32", base, DataType::kHALF, kBadShape,
            {"unsupported dtypes", "cache float16", "nothing was executed"}, false});
        cases.push_back({"null_pointers", base, DataType::kFLOAT, kNullPointer, {"null"}, true});
        for (auto const& cs : cases)
        {
            auto d = descs(cs.s, DataType::kHALF, cs.cacheType);
            size_t const mark = logger.messages.size();
            int32_t const rc = rt->enqueue(d.data(), d.data() + 5, cs.nullPointers ? nullInputs : inputs,
                cs.nullPointers ? nullOutputs : outputs, nullptr, nullptr);
            std::string const msg = logger.lastSince(mark);
            bool named = true;
            std::string missing;
            for (char const* n : cs.needles)
            {
                if (msg.find(n) == std::string::npos)
                {
                    named = false;
                    missing += std::string(" '") + n + "'";
                }
            }
            check(rc == cs.status && logger.errorsSince(mark) == 1 && named, std::string("enqueue.refuses.") + cs.name,
                "rc " + std::to_string(rc) + " (expected " + std::to_string(cs.status) + "), errors "
                    + std::to_string(logger.errorsSince(mark)) + (named ? "" : ", message lacks" + missing) + ": "
                    + msg);
        }
        Shapes empty = base;
        empty.q = {0, 16, 4, 128};
        empty.k = {0, 16, 4, 128};
        auto d = descs(empty, DataType::kHALF);
        check(rt->enqueue(d.data(), d.data() + 5, nullInputs, nullOutputs, nullptr, nullptr) == 0,
            "enqueue.empty_batch_noop", logger.lastSince(0));
    }

    // ---- serialise -> recreate (runtime phase), clone, attachToContext.
    {
        Fields f2 = parserFields(3e-5F, 0, 1);
        IPluginV3* q = create(c, &f2);
        if (q == nullptr)
        {
            check(false, "serialize.create", logger.lastSince(0));
        }
        else
        {
            PluginFieldCollection const* fc = runtimeOf(q)->getFieldsToSerialize();
            bool typesOk = fc != nullptr && fc->nbFields == 3;
            for (int32_t i = 0; typesOk && i < 3; ++i)
            {
                std::printf("SERIALIZED %s %s %d\n", fc->fields[i].name, fieldTypeName(fc->fields[i].type),
                    fc->fields[i].length);
            }
            check(typesOk, "serialize.fields", fc ? std::to_string(fc->nbFields) : "null");
            // Copy as TensorRT would into the plan, then recreate from the copy.
            Fields copy;
            for (int32_t i = 0; fc && i < fc->nbFields; ++i)
            {
                size_t const sz = fc->fields[i].type == PluginFieldType::kFLOAT32 ? 4 : 4;
                std::vector<char> bytes(static_cast<char const*>(fc->fields[i].data),
                    static_cast<char const*>(fc->fields[i].data) + sz * static_cast<size_t>(fc->fields[i].length));
                copy.raw(fc->fields[i].name, bytes, fc->fields[i].type, fc->fields[i].length);
            }
            IPluginV3* r = create(c, &copy, TensorRTPhase::kRUNTIME, "deserialized");
            check(r != nullptr && attrsEqual(serializedAttrs(r), 3e-5F, 0, 1), "serialize.roundtrip",
                r ? attrsString(serializedAttrs(r)) : logger.lastSince(0));
            delete r;

            IPluginV3* cl = q->clone();
            check(cl != nullptr && cl != q && attrsEqual(serializedAttrs(cl), 3e-5F, 0, 1)
                    && coreOf(cl) != nullptr && buildOf(cl) != nullptr && runtimeOf(cl) != nullptr,
                "clone.complete", cl ? attrsString(serializedAttrs(cl)) : "null");
            // The clone's serialized fields must point into the clone, not into q.
            PluginFieldCollection const* fq = runtimeOf(q)->getFieldsToSerialize();
            PluginFieldCollection const* fcl = cl ? runtimeOf(cl)->getFieldsToSerialize() : nullptr;
            check(fcl != nullptr && fq != nullptr && fcl->fields[0].data != fq->fields[0].data, "clone.independent");
            delete q; // the clone must outlive its source
            check(cl != nullptr && attrsEqual(serializedAttrs(cl), 3e-5F, 0, 1), "clone.outlives_source");

            IPluginV3* att = cl ? runtimeOf(cl)->attachToContext(nullptr) : nullptr;
            check(att != nullptr && att != cl && attrsEqual(serializedAttrs(att), 3e-5F, 0, 1)
                    && buildOf(att) != nullptr,
                "attach_to_context.complete");
            delete cl;
            delete att;
        }
    }
    delete p;
}

int parseArgs(int argc, char** argv, Args& a)
{
    for (int i = 1; i < argc; ++i)
    {
        std::string const k = argv[i];
        auto next = [&]() -> std::string {
            if (i + 1 >= argc)
            {
                std::fprintf(stderr, "missing value after %s\n", k.c_str());
                std::exit(2);
            }
            return argv[++i];
        };
        if (k == "--vc")
            a.vc = next();
        else if (k == "--plugin")
            a.plugin = next();
        else if (k == "--expect-name")
            a.name = next();
        else if (k == "--expect-version")
            a.version = next();
        else if (k == "--expect-namespace")
            a.ns = next();
        else if (k == "--expect-field")
        {
            std::string v = next();
            auto c = v.find(':');
            a.fields.emplace_back(v.substr(0, c), c == std::string::npos ? "" : v.substr(c + 1));
        }
        else if (k == "--default")
        {
            std::string v = next();
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

} // namespace

int main(int argc, char** argv)
{
    Args args;
    if (int rc = parseArgs(argc, argv, args))
    {
        return rc;
    }

    // ---- the version-compatible library: getCreators + setLoggerFinder only.
    void* vc = dlopen(args.vc.c_str(), RTLD_NOW | RTLD_LOCAL);
    check(vc != nullptr, "vc.dlopen", vc ? "" : dlerror());
    if (vc != nullptr)
    {
        auto getCreators = reinterpret_cast<GetCreatorsFn>(dlsym(vc, "getCreators"));
        auto setFinder = reinterpret_cast<SetLoggerFinderFn>(dlsym(vc, "setLoggerFinder"));
        check(getCreators != nullptr && setFinder != nullptr, "vc.entry_points");
        check(gRegistry.entries.empty() && gRegistryCalls == 0, "vc.no_self_registration",
            std::to_string(gRegistryCalls) + " getPluginRegistry calls");
        if (getCreators && setFinder)
        {
            setFinder(&gFinder);
            int32_t n = -1;
            IPluginCreatorInterface* const* creators = getCreators(n);
            check(n == 1 && creators != nullptr && creators[0] != nullptr, "vc.get_creators", std::to_string(n));
            if (n == 1 && creators && creators[0])
            {
                auto* creator = static_cast<IPluginCreatorV3One*>(creators[0]);
                testCreator(creator, args);
                size_t const globalBefore = gGlobalLogger.messages.size();
                testCreate(creator, args, gFinderLogger);
                testPlugin(creator, gFinderLogger);
                check(gGlobalLogger.messages.size() == globalBefore && !gFinderLogger.messages.empty(),
                    "vc.logs_through_logger_finder",
                    std::to_string(gGlobalLogger.messages.size() - globalBefore) + " messages went elsewhere");
                int32_t n2 = -1;
                check(getCreators(n2)[0] == creators[0] && n2 == 1, "vc.get_creators_stable");
            }
        }
    }

    // ---- the self-registering library: registers with getPluginRegistry() when loaded.
    void* lib = dlopen(args.plugin.c_str(), RTLD_NOW | RTLD_LOCAL);
    check(lib != nullptr, "plugin.dlopen", lib ? "" : dlerror());
    if (lib != nullptr)
    {
        check(dlsym(lib, "getCreators") == nullptr && dlsym(lib, "setLoggerFinder") == nullptr,
            "plugin.exports_nothing");
        check(gRegistry.entries.size() == 1, "plugin.self_registration",
            std::to_string(gRegistry.entries.size()) + " creators registered");
        if (gRegistry.entries.size() == 1)
        {
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
            size_t const mark = gGlobalLogger.messages.size();
            IPluginV3* p = creator->createPlugin("reg_node", f.get(), TensorRTPhase::kBUILD);
            check(p == nullptr && gGlobalLogger.errorsSince(mark) == 1, "plugin.logs_through_get_logger",
                gGlobalLogger.lastSince(mark));
            delete p;
            Fields g = parserFields(1e-6F, 1, 0);
            p = creator->createPlugin("reg_node", g.get(), TensorRTPhase::kBUILD);
            check(p != nullptr, "plugin.registered_creator_creates");
            delete p;
        }
    }

    std::printf("SUMMARY passed=%d failed=%d\n", gPassed, gFailed);
    // Libraries are left loaded: static destructors run at exit in the usual order.
    return gFailed == 0 ? 0 : 1;
}
