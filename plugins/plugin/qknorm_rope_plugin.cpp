// qkrope: TensorRT IPluginV3 adapter for the fused QK-RMSNorm + RoPE kernel (the contract is in
// the header, the fields in qknorm_rope_fields.h).
#include "qknorm_rope_plugin.h"

#include "qknorm_rope_check.h"
#include "qknorm_rope_trt_runtime.h"

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
using nvinfer1::PluginFieldCollection;
using nvinfer1::PluginTensorDesc;
using nvinfer1::TensorFormat;

namespace
{

// "QKNormRoPE plugin (qkrope::QKNormRoPE v1)": how every message names the plugin.
std::string pluginId()
{
    return std::string("QKNormRoPE plugin (") + kPLUGIN_NAMESPACE + "::" + kPLUGIN_NAME + " v" + kPLUGIN_VERSION + ")";
}

void logOutOfMemory() noexcept
{
    logMessage(ILogger::Severity::kERROR, "QKNormRoPE plugin: error (message allocation failed)");
}

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

// q, k, q_weight, k_weight, cos_sin_cache, q_out, k_out (IOIndex order).
char const* const kTENSOR_NAMES[kNB_INPUTS + kNB_OUTPUTS]
    = {"q", "k", "q_weight", "k_weight", "cos_sin_cache", "q_out", "k_out"};

bool validRank(int32_t nbDims) noexcept
{
    return nbDims >= 0 && nbDims <= Dims::MAX_DIMS;
}

std::string dimsString(Dims const& d)
{
    if (!validRank(d.nbDims))
    {
        return "[invalid rank " + std::to_string(d.nbDims) + "]";
    }
    std::ostringstream os;
    os << "[";
    for (int32_t i = 0; i < d.nbDims; ++i)
    {
        os << (i ? ", " : "") << d.d[i];
    }
    os << "]";
    return os.str();
}

// Tensor `t` (IOIndex) with this rank, or an empty string when it is one a Dims can hold.
std::string rankError(int32_t t, int32_t nbDims)
{
    if (validRank(nbDims))
    {
        return {};
    }
    return std::string(t < kNB_INPUTS ? "input " : "output ") + std::to_string(t < kNB_INPUTS ? t : t - kNB_INPUTS)
        + " (" + kTENSOR_NAMES[t] + ") has an invalid rank: nbDims = " + std::to_string(nbDims) + ", expected 0 to "
        + std::to_string(Dims::MAX_DIMS);
}

Dims const& dimsOf(PluginTensorDesc const& d) noexcept
{
    return d.dims;
}

Dims const& dimsOf(DynamicPluginTensorDesc const& d) noexcept
{
    return d.desc.dims;
}

// The first thing every entry point that receives tensor descriptors does: every rank (inputs and
// outputs) within [0, Dims::MAX_DIMS] before any extent d[j] is read or printed.
template <typename Desc>
std::string checkRanks(Desc const* in, Desc const* out)
{
    for (int32_t t = 0; t < kNB_INPUTS + kNB_OUTPUTS; ++t)
    {
        std::string err = rankError(t, dimsOf(t < kNB_INPUTS ? in[t] : out[t - kNB_INPUTS]).nbDims);
        if (!err.empty())
        {
            return err;
        }
    }
    return {};
}

// Dimension checks shared by build-time (possibly unknown, -1) and run-time (known) shapes.
// dims: q, k, q_weight, k_weight, cache; the weights are [head_dim] with norm_scope 0 and
// [num_heads * head_dim] with 1. Returns an empty string when consistent.
std::string checkDims(Dims const* d, int32_t normScope)
{
    static int32_t const kRanks[kNB_INPUTS] = {4, 4, 1, 1, 2};
    std::ostringstream os;
    for (int32_t i = 0; i < kNB_INPUTS; ++i)
    {
        if (d[i].nbDims != kRanks[i])
        {
            os << "input " << i << " (" << kTENSOR_NAMES[i] << ") has rank " << d[i].nbDims << " " << dimsString(d[i])
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
    int64_t const numHeads = known(d[kQ].d[2]) ? d[kQ].d[2] : d[kK].d[2];
    bool const row = normScope == kNORM_SCOPE_ROW;
    // headDim is in [2, kMAX_HEAD_DIM] here when known; the product is formed only where it fits.
    if (row && known(numHeads) && known(headDim) && numHeads > std::numeric_limits<int64_t>::max() / headDim)
    {
        os << "q " << dimsString(d[kQ]) << ": num_heads * head_dim overflows int64 (norm_scope 1 weights are that "
           << "long); expected num_heads * head_dim <= " << std::numeric_limits<int64_t>::max();
        return os.str();
    }
    int64_t const width = row ? (known(numHeads) && known(headDim) ? numHeads * headDim : -1) : headDim;
    for (int32_t w : {static_cast<int32_t>(kQ_WEIGHT), static_cast<int32_t>(kK_WEIGHT)})
    {
        if (known(width) && known(d[w].d[0]) && d[w].d[0] != width)
        {
            os << kTENSOR_NAMES[w] << " has length " << d[w].d[0]
               << (row ? ", expected num_heads * head_dim (norm_scope 1) = " : ", expected head_dim = ") << width;
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


std::string countError(int32_t nbInputs, int32_t nbOutputs)
{
    return "expected 5 inputs (q, k, q_weight, k_weight, cos_sin_cache) and 2 outputs, got " + std::to_string(nbInputs)
        + " and " + std::to_string(nbOutputs);
}

} // namespace

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
        std::string const full = pluginId() + ", layer '" + mLayerName + "': " + msg;
        logMessage(ILogger::Severity::kERROR, full.c_str());
    }
    catch (...)
    {
        logOutOfMemory();
    }
}

template <typename R, typename Body>
R QKNormRoPEPlugin::run(char const* where, R failure, Body&& body) const noexcept
{
    return guarded(
        failure, std::forward<Body>(body), [&](std::string const& msg) { logError(where + (": " + msg)); },
        logOutOfMemory);
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
    return run<IPluginV3*>("clone", nullptr, [&] { return new QKNormRoPEPlugin(*this); });
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
    return run<int32_t>("configurePlugin", 1, [&] {
        QKROPE_VALIDATE(in != nullptr && out != nullptr && nbInputs == kNB_INPUTS && nbOutputs == kNB_OUTPUTS,
            countError(nbInputs, nbOutputs));
        std::string err = checkRanks(in, out);
        QKROPE_VALIDATE(err.empty(), err);
        Dims d[kNB_INPUTS];
        for (int32_t i = 0; i < kNB_INPUTS; ++i)
        {
            d[i] = in[i].desc.dims; // -1 where the dimension is dynamic
        }
        err = checkDims(d, mAttrs.normScope);
        QKROPE_VALIDATE(err.empty(), err);
        return 0;
    });
}

int32_t QKNormRoPEPlugin::getOutputDataTypes(
    DataType* outputTypes, int32_t nbOutputs, DataType const* inputTypes, int32_t nbInputs) const noexcept
{
    return run<int32_t>("getOutputDataTypes", 1, [&] {
        QKROPE_VALIDATE(outputTypes != nullptr && inputTypes != nullptr && nbInputs == kNB_INPUTS
                && nbOutputs == kNB_OUTPUTS,
            countError(nbInputs, nbOutputs));
        QKROPE_VALIDATE(isActivationType(inputTypes[kQ]) && inputTypes[kK] == inputTypes[kQ],
            std::string("q is ") + dataTypeName(inputTypes[kQ]) + " and k is " + dataTypeName(inputTypes[kK])
                + "; expected q and k of one dtype among float32, float16, bfloat16");
        outputTypes[0] = inputTypes[kQ];
        outputTypes[1] = inputTypes[kK];
        return 0;
    });
}

int32_t QKNormRoPEPlugin::getOutputShapes(DimsExprs const* inputs, int32_t nbInputs, DimsExprs const* /*shapeInputs*/,
    int32_t /*nbShapeInputs*/, DimsExprs* outputs, int32_t nbOutputs, nvinfer1::IExprBuilder& /*exprBuilder*/) noexcept
{
    return run<int32_t>("getOutputShapes", 1, [&] {
        QKROPE_VALIDATE(inputs != nullptr && outputs != nullptr && nbInputs == kNB_INPUTS && nbOutputs == kNB_OUTPUTS,
            countError(nbInputs, nbOutputs));
        // Check what is known at network-definition time: ranks, and dimensions that are constants.
        Dims d[kNB_INPUTS];
        for (int32_t i = 0; i < kNB_INPUTS; ++i)
        {
            std::string const err = rankError(i, inputs[i].nbDims);
            QKROPE_VALIDATE(err.empty(), err);
            d[i].nbDims = inputs[i].nbDims;
            for (int32_t j = 0; j < inputs[i].nbDims; ++j)
            {
                nvinfer1::IDimensionExpr const* e = inputs[i].d[j];
                d[i].d[j] = (e != nullptr && e->isConstant()) ? e->getConstantValue() : -1;
            }
        }
        std::string const err = checkDims(d, mAttrs.normScope);
        QKROPE_VALIDATE(err.empty(), err);
        outputs[0] = inputs[kQ];
        outputs[1] = inputs[kK];
        return 0;
    });
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
    // q_weight: q's type or float32 (FLUX.3's fp32 norm weights under bf16); k_weight follows it
    case kQ_WEIGHT: return desc.type == inOut[kQ].desc.type || desc.type == DataType::kFLOAT;
    case kK_WEIGHT: return desc.type == inOut[kQ_WEIGHT].desc.type;
    default: return desc.type == inOut[kQ].desc.type; // k and both outputs follow q
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
    return run<int32_t>("onShapeChange", 1, [&] {
        QKROPE_VALIDATE(in != nullptr && out != nullptr && nbInputs == kNB_INPUTS && nbOutputs == kNB_OUTPUTS,
            countError(nbInputs, nbOutputs));
        std::string err = checkRanks(in, out);
        QKROPE_VALIDATE(err.empty(), err);
        Dims d[kNB_INPUTS];
        for (int32_t i = 0; i < kNB_INPUTS; ++i)
        {
            d[i] = in[i].dims;
        }
        err = checkDims(d, mAttrs.normScope);
        QKROPE_VALIDATE(err.empty(), err);
        return 0;
    });
}

namespace
{

// enqueue's checks: ranks, resolved input extents (copied into d), checkDims, outputs shaped like
// their inputs, and the dtypes. Returns an empty string when the call may run.
std::string checkRuntimeTensors(
    PluginTensorDesc const* inputDesc, PluginTensorDesc const* outputDesc, Dims* d, int32_t normScope)
{
    std::string err = checkRanks(inputDesc, outputDesc);
    if (!err.empty())
    {
        return err;
    }
    for (int32_t i = 0; i < kNB_INPUTS; ++i)
    {
        d[i] = inputDesc[i].dims;
    }
    for (int32_t i = 0; i < kNB_INPUTS; ++i)
    {
        for (int32_t j = 0; j < d[i].nbDims; ++j)
        {
            if (d[i].d[j] < 0)
            {
                return "input " + std::to_string(i) + " has an unresolved shape " + dimsString(d[i]);
            }
        }
    }
    err = checkDims(d, normScope);
    if (!err.empty())
    {
        return err;
    }
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
            return std::string(o == 0 ? "q_out " : "k_out ") + dimsString(od) + " differs from its input "
                + dimsString(id);
        }
    }
    DataType const t = inputDesc[kQ].type;
    bool typesOk = isActivationType(t) && inputDesc[kCACHE].type == DataType::kFLOAT;
    typesOk = typesOk && inputDesc[kK].type == t;
    DataType const w = inputDesc[kQ_WEIGHT].type;
    typesOk = typesOk && (w == t || w == DataType::kFLOAT) && inputDesc[kK_WEIGHT].type == w;
    typesOk = typesOk && outputDesc[0].type == t && outputDesc[1].type == t;
    if (!typesOk)
    {
        return std::string("unsupported dtypes: q ") + dataTypeName(t) + ", k " + dataTypeName(inputDesc[kK].type)
            + ", weights " + dataTypeName(inputDesc[kQ_WEIGHT].type) + "/" + dataTypeName(inputDesc[kK_WEIGHT].type)
            + ", cache " + dataTypeName(inputDesc[kCACHE].type)
            + "; expected q, k and outputs of one dtype (float32/float16/bfloat16), both weights of q's dtype or"
              " float32, and a float32 cache";
    }
    return {};
}

} // namespace

int32_t QKNormRoPEPlugin::enqueue(PluginTensorDesc const* inputDesc, PluginTensorDesc const* outputDesc,
    void const* const* inputs, void* const* outputs, void* /*workspace*/, cudaStream_t stream) noexcept
{
    return run<int32_t>("enqueue", static_cast<int32_t>(Status::kCUDA_ERROR), [&] {
        QKROPE_VALIDATE(inputDesc != nullptr && outputDesc != nullptr && inputs != nullptr && outputs != nullptr,
            "null tensor descriptors or pointers", static_cast<int32_t>(Status::kNULL_POINTER));
        Dims d[kNB_INPUTS];
        std::string const err = checkRuntimeTensors(inputDesc, outputDesc, d, mAttrs.normScope);
        QKROPE_VALIDATE(err.empty(), err + "; nothing was executed", static_cast<int32_t>(Status::kBAD_SHAPE));

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
        p.normScope = mAttrs.normScope;
        switch (inputDesc[kQ].type)
        {
        case DataType::kHALF: p.dtype = qkrope::DataType::kFLOAT16; break;
        case DataType::kBF16: p.dtype = qkrope::DataType::kBFLOAT16; break;
        default: p.dtype = qkrope::DataType::kFLOAT32; break;
        }
        p.weightsFp32 = inputDesc[kQ_WEIGHT].type == DataType::kFLOAT; // checkRuntimeTensors: q's type or this
        if (p.batch == 0 || p.seqLen == 0 || p.numHeads == 0)
        {
            return 0; // empty tensors: nothing to do (TensorRT may pass null addresses for them)
        }
        // The kernel's C-ABI boundary checks the parameters (launchQKNormRoPE calls checkParams
        // first); the plugin's own checks of the shapes were checkRuntimeTensors above.
        Status const st = launchQKNormRoPE(p, stream);
        QKROPE_VALIDATE(st == Status::kSUCCESS,
            std::string(statusString(st)) + " (q " + dimsString(d[kQ]) + ", cos_sin_cache " + dimsString(d[kCACHE])
                + ")",
            static_cast<int32_t>(st));
        return 0;
    });
}

IPluginV3* QKNormRoPEPlugin::attachToContext(nvinfer1::IPluginResourceContext* /*context*/) noexcept
{
    // No per-context resources: the clone is complete and independent.
    return clone();
}

PluginFieldCollection const* QKNormRoPEPlugin::getFieldsToSerialize() noexcept
{
    return run<PluginFieldCollection const*>("getFieldsToSerialize", nullptr, [&] {
        mSerialFields = serializedFields(mAttrs);
        mSerialFC.nbFields = static_cast<int32_t>(mSerialFields.size());
        mSerialFC.fields = mSerialFields.data();
        return &mSerialFC;
    });
}

// ---------------------------------------------------------------------------------------------
// QKNormRoPEPluginCreator

QKNormRoPEPluginCreator::QKNormRoPEPluginCreator()
    : mFields(advertisedFields())
{
    mFC.nbFields = static_cast<int32_t>(mFields.size());
    mFC.fields = mFields.data();
}

IPluginV3* QKNormRoPEPluginCreator::createPlugin(
    char const* name, PluginFieldCollection const* fc, nvinfer1::TensorRTPhase phase) noexcept
{
    char const* const layer = name != nullptr ? name : "";
    bool parsed = false;
    auto report = [&](std::string const& msg) {
        std::string const full = pluginId() + ", layer '" + layer + "': cannot create the plugin ("
            + (phase == nvinfer1::TensorRTPhase::kBUILD ? "build" : "runtime") + " phase): " + msg
            + (parsed ? std::string() : ". Fix: export the node with the qkrope exporter, which writes "
                       + exportedFieldsHint() + ".");
        logMessage(ILogger::Severity::kERROR, full.c_str());
    };
    return guarded<IPluginV3*>(
        nullptr,
        [&] {
            QKNormRoPEAttributes const attrs = parseFields(fc);
            parsed = true;
            return new QKNormRoPEPlugin(layer, attrs);
        },
        report, logOutOfMemory);
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
