// qkrope: TensorRT IPluginV3 adapter for the fused QK-RMSNorm + RoPE kernel (see the header for
// the contract and the field parsing rules).
#include "qknorm_rope_plugin.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <limits>
#include <sstream>

namespace qkrope
{
namespace plugin
{

using nvinfer1::DataType;
using nvinfer1::Dims;
using nvinfer1::DimsExprs;
using nvinfer1::DynamicPluginTensorDesc;
using nvinfer1::ILogger;
using nvinfer1::IPluginCapability;
using nvinfer1::IPluginV3;
using nvinfer1::PluginCapabilityType;
using nvinfer1::PluginField;
using nvinfer1::PluginFieldCollection;
using nvinfer1::PluginFieldType;
using nvinfer1::PluginTensorDesc;
using nvinfer1::TensorFormat;

namespace
{

bool isActivationType(DataType t) noexcept
{
    return t == DataType::kFLOAT || t == DataType::kHALF || t == DataType::kBF16;
}

char const* dataTypeName(DataType t) noexcept
{
    switch (t)
    {
    case DataType::kFLOAT: return "float32";
    case DataType::kHALF: return "float16";
    case DataType::kBF16: return "bfloat16";
    case DataType::kINT8: return "int8";
    case DataType::kINT32: return "int32";
    case DataType::kINT64: return "int64";
    case DataType::kBOOL: return "bool";
    case DataType::kUINT8: return "uint8";
    default: break;
    }
    return "an unsupported type";
}

char const* fieldTypeName(PluginFieldType t) noexcept
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
    return "an unsupported PluginFieldType";
}

std::string dimsString(Dims const& d)
{
    std::ostringstream os;
    os << "[";
    for (int32_t i = 0; i < d.nbDims; ++i)
    {
        os << (i ? ", " : "") << d.d[i];
    }
    os << "]";
    return os.str();
}

// Reads a length-1 integer field of any accepted integer type.
bool readIntField(PluginField const& f, int64_t& value, std::string& err)
{
    switch (f.type)
    {
    case PluginFieldType::kINT32: value = *static_cast<int32_t const*>(f.data); return true;
    case PluginFieldType::kINT64: value = *static_cast<int64_t const*>(f.data); return true;
    case PluginFieldType::kINT16: value = *static_cast<int16_t const*>(f.data); return true;
    case PluginFieldType::kINT8: value = *static_cast<int8_t const*>(f.data); return true;
    default: break;
    }
    err = std::string("has type ") + fieldTypeName(f.type)
        + ", expected kINT32 (an ONNX INT attribute; kINT64/kINT16/kINT8 are accepted too)";
    return false;
}

bool readFloatField(PluginField const& f, double& value, std::string& err)
{
    switch (f.type)
    {
    case PluginFieldType::kFLOAT32: value = *static_cast<float const*>(f.data); return true;
    case PluginFieldType::kFLOAT64: value = *static_cast<double const*>(f.data); return true;
    default: break;
    }
    err = std::string("has type ") + fieldTypeName(f.type)
        + ", expected kFLOAT32 (an ONNX FLOAT attribute; kFLOAT64 is accepted too)";
    return false;
}

// A kCHAR field: length may or may not count a trailing NUL.
bool readStringField(PluginField const& f, std::string& value, std::string& err)
{
    if (f.type != PluginFieldType::kCHAR)
    {
        err = std::string("has type ") + fieldTypeName(f.type) + ", expected kCHAR (an ONNX STRING attribute)";
        return false;
    }
    auto const* s = static_cast<char const*>(f.data);
    size_t n = 0;
    while (n < static_cast<size_t>(f.length) && s[n] != '\0')
    {
        ++n;
    }
    value.assign(s, n);
    return true;
}

// Dimension checks shared by build-time (possibly unknown, -1) and run-time (known) shapes.
// dims: q, k, q_weight, k_weight, cache. Returns an empty string when consistent.
std::string checkDims(Dims const* d)
{
    static char const* const kNames[kNB_INPUTS] = {"q", "k", "q_weight", "k_weight", "cos_sin_cache"};
    static int32_t const kRanks[kNB_INPUTS] = {4, 4, 1, 1, 2};
    std::ostringstream os;
    for (int32_t i = 0; i < kNB_INPUTS; ++i)
    {
        if (d[i].nbDims != kRanks[i])
        {
            os << "input " << i << " (" << kNames[i] << ") has rank " << d[i].nbDims << " " << dimsString(d[i])
               << ", expected rank " << kRanks[i];
            return os.str();
        }
    }
    auto known = [](int64_t v) { return v >= 0; };
    for (int32_t j = 0; j < 4; ++j)
    {
        if (known(d[kQ].d[j]) && known(d[kK].d[j]) && d[kQ].d[j] != d[kK].d[j])
        {
            os << "q " << dimsString(d[kQ]) << " and k " << dimsString(d[kK])
               << " must have the same shape [batch, seq_len, num_heads, head_dim]";
            return os.str();
        }
    }
    int64_t const headDim = known(d[kQ].d[3]) ? d[kQ].d[3] : d[kK].d[3];
    int64_t const seqLen = known(d[kQ].d[1]) ? d[kQ].d[1] : d[kK].d[1];
    if (known(headDim) && (headDim % 2 != 0 || headDim == 0 || headDim > kMAX_HEAD_DIM))
    {
        os << "head_dim " << headDim << " is not supported: expected an even value in [2, " << kMAX_HEAD_DIM << "]";
        return os.str();
    }
    for (int32_t w : {static_cast<int32_t>(kQ_WEIGHT), static_cast<int32_t>(kK_WEIGHT)})
    {
        if (known(headDim) && known(d[w].d[0]) && d[w].d[0] != headDim)
        {
            os << kNames[w] << " has length " << d[w].d[0] << ", expected head_dim = " << headDim;
            return os.str();
        }
    }
    int64_t const rows = d[kCACHE].d[0];
    int64_t const rot = d[kCACHE].d[1];
    if (known(rot) && (rot <= 0 || rot % 2 != 0 || (known(headDim) && rot > headDim)))
    {
        os << "cos_sin_cache " << dimsString(d[kCACHE]) << " has rotary_dim " << rot
           << ": expected an even value in [2, head_dim = " << headDim << "]";
        return os.str();
    }
    if (known(rows) && known(seqLen) && rows < seqLen)
    {
        os << "cos_sin_cache overflow: required rows (seq_len) = " << seqLen << ", cache rows = " << rows
           << ", overflow = " << (seqLen - rows) << "; build the cache for every token of the stream";
        return os.str();
    }
    return {};
}

std::string attributeSummary(QKNormRoPEAttributes const& a)
{
    char buf[128];
    std::snprintf(buf, sizeof(buf), "epsilon=%.9g;interleaved=%d;rounding=%d", static_cast<double>(a.epsilon),
        static_cast<int>(a.interleaved), static_cast<int>(a.rounding));
    return buf;
}

} // namespace

bool parseFields(PluginFieldCollection const* fc, QKNormRoPEAttributes& out, std::string& error) noexcept
{
    try
    {
        QKNormRoPEAttributes a;
        if (fc == nullptr || fc->nbFields == 0)
        {
            out = a;
            return true;
        }
        if (fc->nbFields < 0 || fc->fields == nullptr)
        {
            error = "the PluginFieldCollection is malformed (nbFields = " + std::to_string(fc->nbFields)
                + ", fields = " + (fc->fields ? "set" : "null") + ")";
            return false;
        }
        bool seen[5] = {false, false, false, false, false};
        for (int32_t i = 0; i < fc->nbFields; ++i)
        {
            PluginField const& f = fc->fields[i];
            if (f.name == nullptr)
            {
                error = "field " + std::to_string(i) + " has no name";
                return false;
            }
            std::string const name = f.name;
            int32_t slot = -1;
            if (name == "epsilon")
            {
                slot = 0;
            }
            else if (name == "interleaved")
            {
                slot = 1;
            }
            else if (name == "rounding")
            {
                slot = 2;
            }
            else if (name == "plugin_version")
            {
                slot = 3;
            }
            else if (name == "plugin_namespace")
            {
                slot = 4;
            }
            else
            {
                error = "unknown field '" + name
                    + "'; accepted fields: epsilon (kFLOAT32), interleaved (kINT32), rounding (kINT32)";
                return false;
            }
            if (seen[slot])
            {
                error = "field '" + name + "' is given twice";
                return false;
            }
            seen[slot] = true;
            std::string why;
            if (f.data == nullptr)
            {
                error = "field '" + name + "' has no data";
                return false;
            }
            bool const isFloat = f.type == PluginFieldType::kFLOAT32 || f.type == PluginFieldType::kFLOAT64;
            bool const isInt = f.type == PluginFieldType::kINT32 || f.type == PluginFieldType::kINT64
                || f.type == PluginFieldType::kINT16 || f.type == PluginFieldType::kINT8;
            if ((slot == 0 && !isFloat) || ((slot == 1 || slot == 2) && !isInt))
            {
                error = "field '" + name + "' has type " + fieldTypeName(f.type)
                    + (slot == 0 ? ", expected kFLOAT32 (an ONNX FLOAT attribute; kFLOAT64 is accepted too)"
                                 : ", expected kINT32 (an ONNX INT attribute; kINT64/kINT16/kINT8 are accepted too)");
                return false;
            }
            if (slot <= 2 && f.length != 1)
            {
                error = "field '" + name + "' has length " + std::to_string(f.length) + ", expected 1 (a scalar)";
                return false;
            }
            if (slot == 0)
            {
                double v = 0.0;
                if (!readFloatField(f, v, why))
                {
                    error = "field 'epsilon' " + why;
                    return false;
                }
                if (!(std::isfinite(v) && v > 0.0 && v <= static_cast<double>(std::numeric_limits<float>::max())
                        && static_cast<float>(v) > 0.0F))
                {
                    char buf[64];
                    std::snprintf(buf, sizeof(buf), "%.9g", v);
                    error = std::string("field 'epsilon' = ") + buf
                        + " is invalid: expected a finite float32 > 0 (default 1e-6, Qwen-Image uses 1e-6)";
                    return false;
                }
                a.epsilon = static_cast<float>(v);
            }
            else if (slot <= 2)
            {
                int64_t v = 0;
                if (!readIntField(f, v, why))
                {
                    error = "field '" + name + "' " + why;
                    return false;
                }
                if (v != 0 && v != 1)
                {
                    error = "field '" + name + "' = " + std::to_string(v) + " is invalid: expected 0 or 1"
                        + (slot == 1 ? " (1: interleaved pairs (2j, 2j+1) as in Qwen-Image/GPT-J; 0: NeoX halves)"
                                     : " (0: one rounding at the end; 1: diffusers' eager rounding order)");
                    return false;
                }
                (slot == 1 ? a.interleaved : a.rounding) = static_cast<int32_t>(v);
            }
            else
            {
                std::string v;
                if (!readStringField(f, v, why))
                {
                    error = "field '" + name + "' " + why;
                    return false;
                }
                char const* expected = slot == 3 ? kPLUGIN_VERSION : kPLUGIN_NAMESPACE;
                if (v != expected)
                {
                    error = "field '" + name + "' = \"" + v + "\" does not match this plugin (expected \""
                        + expected + "\")";
                    return false;
                }
            }
        }
        out = a;
        return true;
    }
    catch (std::exception const& e)
    {
        error = std::string("internal error while parsing fields: ") + e.what();
    }
    catch (...)
    {
        error = "internal error while parsing fields";
    }
    return false;
}

// ---------------------------------------------------------------------------------------------
// QKNormRoPEPlugin

QKNormRoPEPlugin::QKNormRoPEPlugin(std::string layerName, QKNormRoPEAttributes const& attrs)
    : mLayerName(std::move(layerName))
    , mAttrs(attrs)
    , mCacheID(attributeSummary(attrs))
{
}

QKNormRoPEPlugin::QKNormRoPEPlugin(QKNormRoPEPlugin const& other)
    : IPluginV3(other)
    , IPluginV3OneCore(other)
    , IPluginV3OneBuild(other)
    , IPluginV3OneRuntime(other)
    , mLayerName(other.mLayerName)
    , mAttrs(other.mAttrs)
    , mCacheID(other.mCacheID)
{
    // mSerialFields / mSerialFC point into the object they belong to: rebuilt on demand.
}

void QKNormRoPEPlugin::logError(std::string const& msg) const noexcept
{
    try
    {
        std::string const full = std::string("QKNormRoPE plugin (") + kPLUGIN_NAMESPACE + "::" + kPLUGIN_NAME + " v"
            + kPLUGIN_VERSION + "), layer '" + mLayerName + "': " + msg;
        logMessage(ILogger::Severity::kERROR, full.c_str());
    }
    catch (...)
    {
        logMessage(ILogger::Severity::kERROR, "QKNormRoPE plugin: error (message allocation failed)");
    }
}

IPluginCapability* QKNormRoPEPlugin::getCapabilityInterface(PluginCapabilityType type) noexcept
{
    switch (type)
    {
    case PluginCapabilityType::kCORE: return static_cast<nvinfer1::IPluginV3OneCore*>(this);
    case PluginCapabilityType::kBUILD: return static_cast<nvinfer1::IPluginV3OneBuild*>(this);
    case PluginCapabilityType::kRUNTIME: return static_cast<nvinfer1::IPluginV3OneRuntime*>(this);
    }
    return nullptr;
}

IPluginV3* QKNormRoPEPlugin::clone() noexcept
{
    try
    {
        return new QKNormRoPEPlugin(*this);
    }
    catch (std::exception const& e)
    {
        logError(std::string("clone failed: ") + e.what());
    }
    catch (...)
    {
        logError("clone failed");
    }
    return nullptr;
}

char const* QKNormRoPEPlugin::getPluginName() const noexcept
{
    return kPLUGIN_NAME;
}

char const* QKNormRoPEPlugin::getPluginVersion() const noexcept
{
    return kPLUGIN_VERSION;
}

char const* QKNormRoPEPlugin::getPluginNamespace() const noexcept
{
    return kPLUGIN_NAMESPACE;
}

int32_t QKNormRoPEPlugin::getNbOutputs() const noexcept
{
    return kNB_OUTPUTS;
}

int32_t QKNormRoPEPlugin::configurePlugin(
    DynamicPluginTensorDesc const* in, int32_t nbInputs, DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept
{
    try
    {
        if (in == nullptr || out == nullptr || nbInputs != kNB_INPUTS || nbOutputs != kNB_OUTPUTS)
        {
            logError("configurePlugin: expected 5 inputs (q, k, q_weight, k_weight, cos_sin_cache) and 2 outputs, got "
                + std::to_string(nbInputs) + " and " + std::to_string(nbOutputs));
            return 1;
        }
        Dims d[kNB_INPUTS];
        for (int32_t i = 0; i < kNB_INPUTS; ++i)
        {
            d[i] = in[i].desc.dims; // -1 where the dimension is dynamic
        }
        std::string const err = checkDims(d);
        if (!err.empty())
        {
            logError("configurePlugin: " + err);
            return 1;
        }
        return 0;
    }
    catch (...)
    {
        logError("configurePlugin: internal error");
    }
    return 1;
}

int32_t QKNormRoPEPlugin::getOutputDataTypes(
    DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes, int32_t nbInputs) const noexcept
{
    try
    {
        if (outputTypes == nullptr || inputTypes == nullptr || nbInputs != kNB_INPUTS || nbOutputs != kNB_OUTPUTS)
        {
            logError("getOutputDataTypes: expected 5 inputs and 2 outputs, got " + std::to_string(nbInputs) + " and "
                + std::to_string(nbOutputs));
            return 1;
        }
        if (!isActivationType(inputTypes[kQ]) || inputTypes[kK] != inputTypes[kQ])
        {
            logError(std::string("getOutputDataTypes: q is ") + dataTypeName(inputTypes[kQ]) + " and k is "
                + dataTypeName(inputTypes[kK]) + "; expected q and k of one dtype among float32, float16, bfloat16");
            return 1;
        }
        outputTypes[0] = inputTypes[kQ];
        outputTypes[1] = inputTypes[kK];
        return 0;
    }
    catch (...)
    {
        logError("getOutputDataTypes: internal error");
    }
    return 1;
}

int32_t QKNormRoPEPlugin::getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const* /*shapeInputs*/,
    int32_t /*nbShapeInputs*/, DimsExprs* outputs, int32_t nbOutputs, nvinfer1::IExprBuilder& /*exprBuilder*/) noexcept
{
    try
    {
        if (inputs == nullptr || outputs == nullptr || nbInputs != kNB_INPUTS || nbOutputs != kNB_OUTPUTS)
        {
            logError("getOutputShapes: expected 5 inputs and 2 outputs, got " + std::to_string(nbInputs) + " and "
                + std::to_string(nbOutputs));
            return 1;
        }
        // Check what is known at network-definition time: ranks, and dimensions that are constants.
        Dims d[kNB_INPUTS];
        for (int32_t i = 0; i < kNB_INPUTS; ++i)
        {
            if (inputs[i].nbDims < 0 || inputs[i].nbDims > Dims::MAX_DIMS)
            {
                logError("getOutputShapes: input " + std::to_string(i) + " has an invalid rank");
                return 1;
            }
            d[i].nbDims = inputs[i].nbDims;
            for (int32_t j = 0; j < inputs[i].nbDims; ++j)
            {
                nvinfer1::IDimensionExpr const* e = inputs[i].d[j];
                d[i].d[j] = (e != nullptr && e->isConstant()) ? e->getConstantValue() : -1;
            }
        }
        std::string const err = checkDims(d);
        if (!err.empty())
        {
            logError("getOutputShapes: " + err);
            return 1;
        }
        outputs[0] = inputs[kQ];
        outputs[1] = inputs[kK];
        return 0;
    }
    catch (...)
    {
        logError("getOutputShapes: internal error");
    }
    return 1;
}

bool QKNormRoPEPlugin::supportsFormatCombination(
    int32_t pos, DynamicPluginTensorDesc const* inOut, int32_t nbInputs, int32_t nbOutputs) noexcept
{
    if (inOut == nullptr || nbInputs != kNB_INPUTS || nbOutputs != kNB_OUTPUTS || pos < 0
        || pos >= kNB_INPUTS + kNB_OUTPUTS)
    {
        return false;
    }
    PluginTensorDesc const& desc = inOut[pos].desc;
    if (desc.format != TensorFormat::kLINEAR)
    {
        return false;
    }
    switch (pos)
    {
    case kQ: return isActivationType(desc.type);
    case kCACHE: return desc.type == DataType::kFLOAT;
    default: return desc.type == inOut[kQ].desc.type; // k, weights and both outputs follow q
    }
}

size_t QKNormRoPEPlugin::getWorkspaceSize(DynamicPluginTensorDesc const* /*inputs*/, int32_t /*nbInputs*/,
    DynamicPluginTensorDesc const* /*outputs*/, int32_t /*nbOutputs*/) const noexcept
{
    return 0;
}

char const* QKNormRoPEPlugin::getTimingCacheID() noexcept
{
    return mCacheID.c_str();
}

char const* QKNormRoPEPlugin::getMetadataString() noexcept
{
    return mCacheID.c_str();
}

int32_t QKNormRoPEPlugin::onShapeChange(
    PluginTensorDesc const* in, int32_t nbInputs, PluginTensorDesc const* out, int32_t nbOutputs) noexcept
{
    try
    {
        if (in == nullptr || out == nullptr || nbInputs != kNB_INPUTS || nbOutputs != kNB_OUTPUTS)
        {
            logError("onShapeChange: expected 5 inputs and 2 outputs, got " + std::to_string(nbInputs) + " and "
                + std::to_string(nbOutputs));
            return 1;
        }
        Dims d[kNB_INPUTS];
        for (int32_t i = 0; i < kNB_INPUTS; ++i)
        {
            d[i] = in[i].dims;
        }
        std::string const err = checkDims(d);
        if (!err.empty())
        {
            logError("onShapeChange: " + err);
            return 1;
        }
        return 0;
    }
    catch (...)
    {
        logError("onShapeChange: internal error");
    }
    return 1;
}

int32_t QKNormRoPEPlugin::enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* outputDesc,
    void const* const* inputs, void* const* outputs, void* /*workspace*/, cudaStream_t stream) noexcept
{
    try
    {
        if (inputDesc == nullptr || outputDesc == nullptr || inputs == nullptr || outputs == nullptr)
        {
            logError("enqueue: null tensor descriptors or pointers");
            return static_cast<int32_t>(Status::kNULL_POINTER);
        }
        Dims d[kNB_INPUTS];
        for (int32_t i = 0; i < kNB_INPUTS; ++i)
        {
            d[i] = inputDesc[i].dims;
            for (int32_t j = 0; j < d[i].nbDims; ++j)
            {
                if (d[i].d[j] < 0)
                {
                    logError("enqueue: input " + std::to_string(i) + " has an unresolved shape " + dimsString(d[i]));
                    return static_cast<int32_t>(Status::kBAD_SHAPE);
                }
            }
        }
        std::string err = checkDims(d);
        if (err.empty())
        {
            for (int32_t o = 0; o < kNB_OUTPUTS; ++o)
            {
                Dims const& od = outputDesc[o].dims;
                Dims const& id = d[o == 0 ? kQ : kK];
                bool same = od.nbDims == id.nbDims;
                for (int32_t j = 0; same && j < od.nbDims; ++j)
                {
                    same = od.d[j] == id.d[j];
                }
                if (!same)
                {
                    err = std::string(o == 0 ? "q_out " : "k_out ") + dimsString(od) + " differs from its input "
                        + dimsString(id);
                    break;
                }
            }
        }
        if (err.empty())
        {
            DataType const t = inputDesc[kQ].type;
            bool typesOk = isActivationType(t) && inputDesc[kCACHE].type == DataType::kFLOAT;
            for (int32_t i : {static_cast<int32_t>(kK), static_cast<int32_t>(kQ_WEIGHT), static_cast<int32_t>(kK_WEIGHT)})
            {
                typesOk = typesOk && inputDesc[i].type == t;
            }
            typesOk = typesOk && outputDesc[0].type == t && outputDesc[1].type == t;
            if (!typesOk)
            {
                err = std::string("unsupported dtypes: q ") + dataTypeName(t) + ", k " + dataTypeName(inputDesc[kK].type)
                    + ", weights " + dataTypeName(inputDesc[kQ_WEIGHT].type) + "/"
                    + dataTypeName(inputDesc[kK_WEIGHT].type) + ", cache " + dataTypeName(inputDesc[kCACHE].type)
                    + "; expected q, k, weights, outputs of one dtype (float32/float16/bfloat16) and a float32 cache";
            }
        }
        if (!err.empty())
        {
            logError("enqueue: " + err + "; nothing was executed");
            return static_cast<int32_t>(Status::kBAD_SHAPE);
        }

        QKNormRoPEParams p;
        p.q = inputs[kQ];
        p.k = inputs[kK];
        p.qWeight = inputs[kQ_WEIGHT];
        p.kWeight = inputs[kK_WEIGHT];
        p.cache = static_cast<float const*>(inputs[kCACHE]);
        p.qOut = outputs[0];
        p.kOut = outputs[1];
        p.batch = d[kQ].d[0];
        p.seqLen = d[kQ].d[1];
        p.numHeads = d[kQ].d[2];
        p.headDim = d[kQ].d[3];
        p.rotaryDim = d[kCACHE].d[1];
        p.cacheRows = d[kCACHE].d[0];
        p.eps = mAttrs.epsilon;
        p.interleaved = mAttrs.interleaved != 0;
        p.rounding = mAttrs.rounding;
        switch (inputDesc[kQ].type)
        {
        case DataType::kHALF: p.dtype = qkrope::DataType::kFLOAT16; break;
        case DataType::kBF16: p.dtype = qkrope::DataType::kBFLOAT16; break;
        default: p.dtype = qkrope::DataType::kFLOAT32; break;
        }
        if (p.batch == 0 || p.seqLen == 0 || p.numHeads == 0)
        {
            return 0; // empty tensors: nothing to do (TensorRT may pass null addresses for them)
        }
        Status st = checkParams(p);
        if (st == Status::kSUCCESS)
        {
            st = launchQKNormRoPE(p, stream);
        }
        if (st != Status::kSUCCESS)
        {
            logError(std::string("enqueue: ") + statusString(st) + " (q " + dimsString(d[kQ]) + ", cos_sin_cache "
                + dimsString(d[kCACHE]) + ")");
            return static_cast<int32_t>(st);
        }
        return 0;
    }
    catch (...)
    {
        logError("enqueue: internal error");
    }
    return static_cast<int32_t>(Status::kCUDA_ERROR);
}

IPluginV3* QKNormRoPEPlugin::attachToContext(nvinfer1::IPluginResourceContext* /*context*/) noexcept
{
    // No per-context resources: the clone is complete and independent.
    return clone();
}

PluginFieldCollection const* QKNormRoPEPlugin::getFieldsToSerialize() noexcept
{
    try
    {
        mSerialFields.clear();
        mSerialFields.emplace_back("epsilon", &mAttrs.epsilon, PluginFieldType::kFLOAT32, 1);
        mSerialFields.emplace_back("interleaved", &mAttrs.interleaved, PluginFieldType::kINT32, 1);
        mSerialFields.emplace_back("rounding", &mAttrs.rounding, PluginFieldType::kINT32, 1);
        mSerialFC.nbFields = static_cast<int32_t>(mSerialFields.size());
        mSerialFC.fields = mSerialFields.data();
        return &mSerialFC;
    }
    catch (...)
    {
        logError("getFieldsToSerialize: internal error");
    }
    return nullptr;
}

// ---------------------------------------------------------------------------------------------
// QKNormRoPEPluginCreator

QKNormRoPEPluginCreator::QKNormRoPEPluginCreator()
{
    mFields.emplace_back("epsilon", nullptr, PluginFieldType::kFLOAT32, 1);
    mFields.emplace_back("interleaved", nullptr, PluginFieldType::kINT32, 1);
    mFields.emplace_back("rounding", nullptr, PluginFieldType::kINT32, 1);
    mFC.nbFields = static_cast<int32_t>(mFields.size());
    mFC.fields = mFields.data();
}

IPluginV3* QKNormRoPEPluginCreator::createPlugin(
    char const* name, PluginFieldCollection const* fc, nvinfer1::TensorRTPhase phase) noexcept
{
    std::string layer;
    try
    {
        layer = name != nullptr ? name : "";
        QKNormRoPEAttributes attrs;
        std::string error;
        if (!parseFields(fc, attrs, error))
        {
            std::string const msg = std::string("QKNormRoPE plugin (") + kPLUGIN_NAMESPACE + "::" + kPLUGIN_NAME + " v"
                + kPLUGIN_VERSION + "), layer '" + layer + "': cannot create the plugin ("
                + (phase == nvinfer1::TensorRTPhase::kBUILD ? "build" : "runtime") + " phase): " + error
                + ". Fix: export the node with the qkrope exporter, which writes epsilon (FLOAT > 0), interleaved "
                  "(INT 0/1) and rounding (INT 0/1).";
            logMessage(ILogger::Severity::kERROR, msg.c_str());
            return nullptr;
        }
        return new QKNormRoPEPlugin(layer, attrs);
    }
    catch (std::exception const& e)
    {
        std::string const msg = "QKNormRoPE plugin, layer '" + layer + "': createPlugin failed: " + e.what();
        logMessage(ILogger::Severity::kERROR, msg.c_str());
    }
    catch (...)
    {
        logMessage(ILogger::Severity::kERROR, "QKNormRoPE plugin: createPlugin failed");
    }
    return nullptr;
}

PluginFieldCollection const* QKNormRoPEPluginCreator::getFieldNames() noexcept
{
    return &mFC;
}

char const* QKNormRoPEPluginCreator::getPluginName() const noexcept
{
    return kPLUGIN_NAME;
}

char const* QKNormRoPEPluginCreator::getPluginVersion() const noexcept
{
    return kPLUGIN_VERSION;
}

char const* QKNormRoPEPluginCreator::getPluginNamespace() const noexcept
{
    return kPLUGIN_NAMESPACE;
}

} // namespace plugin
} // namespace qkrope
