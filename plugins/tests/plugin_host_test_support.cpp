// qkrope: the host test driver's plugin helpers (declared in plugin_host_test.h): capability
// interfaces, creation, the attributes read back through getFieldsToSerialize, tensor
// descriptors for the build- and run-time entry points, and the malformed ranks every entry point
// must refuse.
#include "plugin_host_test.h"

#include <cstdio>

namespace qkrope_host_test
{

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

PluginPtr create(IPluginCreatorV3One* c, Fields* f, TensorRTPhase phase, char const* name)
{
    return PluginPtr(c->createPlugin(name, f ? f->get() : nullptr, phase));
}

PluginPtr createFor(char const* group, IPluginCreatorV3One* c, Fields* f, RecordingLogger const& logger)
{
    PluginPtr p = create(c, f);
    if (p == nullptr)
    {
        check(false, std::string(group) + ".create", logger.lastSince(0));
    }
    return p;
}

std::string Attrs::str() const
{
    char buf[160];
    std::snprintf(buf, sizeof(buf), "epsilon=%.9g interleaved=%d rounding=%d norm_scope=%d %s",
        static_cast<double>(eps), interleaved, rounding, normScope, error.c_str());
    return buf;
}

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
        else if (n == "norm_scope" && f.type == PluginFieldType::kINT32 && f.length == 1)
        {
            a.normScope = *static_cast<int32_t const*>(f.data);
        }
        else
        {
            a.error += "unexpected serialized field '" + n + "' (" + fieldTypeName(f.type) + ", length "
                + std::to_string(f.length) + "); ";
        }
    }
    return a;
}

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

PluginTensorDesc makeDesc(std::vector<int64_t> const& dims, DataType t, TensorFormat f)
{
    PluginTensorDesc d{};
    d.dims = makeDims(dims);
    d.type = t;
    d.format = f;
    d.scale = 1.0F;
    return d;
}

Shapes goodShapes()
{
    return {{2, 16, 4, 128}, {2, 16, 4, 128}, {128}, {128}, {20, 128}};
}

std::vector<PluginTensorDesc> descs(Shapes const& s, DataType t, DataType cacheType)
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

} // namespace qkrope_host_test
