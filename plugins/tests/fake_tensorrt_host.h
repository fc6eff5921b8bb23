// qkrope: stand-ins for the parts of TensorRT the host test driver (plugin_host_test.cpp) plays:
// a recording logger and logger finder, a plugin registry, an IExprBuilder with constant and
// symbolic dimensions, and a PluginFieldCollection laid out the way the ONNX parser builds one.
// Header-only, no libnvinfer: the plugin libraries only ever see these through TensorRT's headers.
#pragma once

#include <NvInferRuntime.h>

#include <cstdint>
#include <cstring>
#include <deque>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace qkrope_test
{

// ---- logging ----------------------------------------------------------------------------------

struct RecordingLogger : nvinfer1::ILogger
{
    std::vector<std::pair<Severity, std::string>> messages;

    void log(Severity severity, nvinfer1::AsciiChar const* msg) noexcept override
    {
        messages.emplace_back(severity, msg ? msg : "");
    }
    size_t mark() const
    {
        return messages.size();
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

struct FixedLoggerFinder : nvinfer1::ILoggerFinder
{
    explicit FixedLoggerFinder(nvinfer1::ILogger& logger)
        : mLogger(&logger)
    {
    }
    nvinfer1::ILogger* findLogger() override
    {
        return mLogger;
    }

private:
    nvinfer1::ILogger* mLogger;
};

// ---- a plugin registry that records registerCreator(IPluginCreatorInterface&, ns) -------------

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
class FakeRegistry : public nvinfer1::IPluginRegistry
{
public:
    using AsciiChar = nvinfer1::AsciiChar;
    using PluginLibraryHandle = nvinfer1::IPluginRegistry::PluginLibraryHandle;
    struct Entry
    {
        nvinfer1::IPluginCreatorInterface* creator;
        std::string ns;
    };
    std::vector<Entry> entries;

#if NV_TENSORRT_MAJOR < 11
    bool registerCreator(nvinfer1::IPluginCreator&, AsciiChar const* const) noexcept override
    {
        return false;
    }
    nvinfer1::IPluginCreator* const* getPluginCreatorList(int32_t* const n) const noexcept override
    {
        *n = 0;
        return nullptr;
    }
    nvinfer1::IPluginCreator* getPluginCreator(
        AsciiChar const* const, AsciiChar const* const, AsciiChar const* const) noexcept override
    {
        return nullptr;
    }
    bool deregisterCreator(nvinfer1::IPluginCreator const&) noexcept override
    {
        return false;
    }
#endif
    void setErrorRecorder(nvinfer1::IErrorRecorder* const) noexcept override {}
    nvinfer1::IErrorRecorder* getErrorRecorder() const noexcept override
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
    bool registerCreator(nvinfer1::IPluginCreatorInterface& creator, AsciiChar const* const ns) noexcept override
    {
        entries.push_back({&creator, ns ? ns : "<null>"});
        return true;
    }
    nvinfer1::IPluginCreatorInterface* const* getAllCreators(int32_t* const n) const noexcept override
    {
        *n = 0;
        return nullptr;
    }
    nvinfer1::IPluginCreatorInterface* getCreator(
        AsciiChar const* const, AsciiChar const* const, AsciiChar const* const) noexcept override
    {
        return nullptr;
    }
    bool deregisterCreator(nvinfer1::IPluginCreatorInterface const&) noexcept override
    {
        return false;
    }
    nvinfer1::IPluginResource* acquirePluginResource(AsciiChar const*, nvinfer1::IPluginResource*) noexcept override
    {
        return nullptr;
    }
    int32_t releasePluginResource(AsciiChar const*) noexcept override
    {
        return 0;
    }
    nvinfer1::IPluginCreatorInterface* const* getAllCreatorsRecursive(int32_t* const n) noexcept override
    {
        *n = 0;
        return nullptr;
    }
};
#pragma GCC diagnostic pop

// ---- an IExprBuilder (TensorRT 10+ pimpl pattern: the public classes forward to apiv::V*) -----

class FakeDimImpl : public nvinfer1::apiv::VDimensionExpr
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

class FakeDim : public nvinfer1::IDimensionExpr
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

class FakeBuilderImpl : public nvinfer1::apiv::VExprBuilder
{
public:
    using IDimensionExpr = nvinfer1::IDimensionExpr;

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
    IDimensionExpr const* operation(
        nvinfer1::DimensionOperation op, IDimensionExpr const& a, IDimensionExpr const& b) override
    {
        using Op = nvinfer1::DimensionOperation;
        ++operations;
        if (!a.isConstant() || !b.isConstant())
        {
            return symbol();
        }
        int64_t const x = a.getConstantValue();
        int64_t const y = b.getConstantValue();
        switch (op)
        {
        case Op::kSUM: return constant(x + y);
        case Op::kPROD: return constant(x * y);
        case Op::kMAX: return constant(x > y ? x : y);
        case Op::kMIN: return constant(x < y ? x : y);
        case Op::kSUB: return constant(x - y);
        case Op::kEQUAL: return constant(x == y);
        case Op::kLESS: return constant(x < y);
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

class FakeExprBuilder : public nvinfer1::IExprBuilder
{
public:
    FakeExprBuilder()
    {
        mImpl = &impl;
    }
    ~FakeExprBuilder() noexcept override = default;
    FakeBuilderImpl impl;
};

// ---- a PluginFieldCollection built field by field (the ONNX parser's layout) ------------------

// Owns the storage of its fields. Copyable: get() rebuilds the PluginField array so that it always
// points into this object.
struct Fields
{
    struct Entry
    {
        std::string name;
        std::vector<char> bytes;
        nvinfer1::PluginFieldType type;
        int32_t length;
        bool nullData;
    };
    std::vector<Entry> entries;
    std::vector<nvinfer1::PluginField> list;
    nvinfer1::PluginFieldCollection fc{};

    template <typename T>
    Fields& add(char const* name, T value, nvinfer1::PluginFieldType type, int32_t length = 1)
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
        return raw(name, std::move(bytes), nvinfer1::PluginFieldType::kCHAR,
            static_cast<int32_t>(s.size() + (countNul ? 1 : 0)));
    }
    Fields& raw(char const* name, std::vector<char> bytes, nvinfer1::PluginFieldType type, int32_t length,
        bool nullData = false)
    {
        entries.push_back({name, std::move(bytes), type, length, nullData});
        return *this;
    }
    nvinfer1::PluginFieldCollection const* get()
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
inline Fields parserFields(float eps, int64_t interleaved, int64_t rounding)
{
    Fields f;
    f.add("epsilon", eps, nvinfer1::PluginFieldType::kFLOAT32);
    f.add("interleaved", static_cast<int32_t>(interleaved), nvinfer1::PluginFieldType::kINT32);
    f.add("rounding", static_cast<int32_t>(rounding), nvinfer1::PluginFieldType::kINT32);
    return f;
}

} // namespace qkrope_test
