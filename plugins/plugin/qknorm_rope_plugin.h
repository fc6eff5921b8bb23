// qkrope: TensorRT IPluginV3 adapter for the fused QK-RMSNorm + RoPE kernel.
//
// The node contract (spec ../shared/spec/qknorm_rope.md, sections 3-4):
//   name "QKNormRoPE", version "1", namespace "qkrope"
//   inputs  q [B,S,H,D], k [B,S,H,D], q_weight [D], k_weight [D], cos_sin_cache [R, rotary_dim] fp32
//   outputs q_out, k_out (same shapes and dtype as q, k)
//   fields  epsilon (kFLOAT32, default 1e-6), interleaved (kINT32, default 1), rounding (kINT32, default 0)
//
// Field parsing rules (QKNormRoPEPluginCreator::createPlugin, both phases):
//   - A missing field takes the spec default (the ONNX parser skips attributes the node lacks).
//   - epsilon: kFLOAT32 (what the parser forwards for a FLOAT attribute); kFLOAT64 is accepted too
//     (Python/numpy callers) when it converts to a finite float32. Must be finite and > 0.
//   - interleaved, rounding: kINT32 (the parser narrows the ONNX int64 to int32); kINT64, kINT16 and
//     kINT8 are accepted too (Python/numpy callers). Must be 0 or 1.
//   - plugin_version / plugin_namespace: the parser does not forward them (they are not in
//     getFieldNames()), but when a caller passes them as kCHAR (with or without the trailing NUL
//     counted in length) they must equal "1" / "qkrope".
//   - Every field must have length 1 (strings: any length) and non-null data. Any other name, a
//     duplicate, a wrong type or an out-of-range value makes createPlugin log one clear error
//     message (through the TensorRT logger) and return nullptr. Nothing throws across the ABI.
#pragma once

#include "qknorm_rope.h"
#include "qknorm_rope_trt_runtime.h"

#include <NvInferRuntime.h>

#include <cstdint>
#include <string>
#include <vector>

namespace qkrope
{
namespace plugin
{

constexpr char const* kPLUGIN_NAME = "QKNormRoPE";
constexpr char const* kPLUGIN_VERSION = "1";
constexpr char const* kPLUGIN_NAMESPACE = "qkrope";

constexpr int32_t kNB_INPUTS = 5;
constexpr int32_t kNB_OUTPUTS = 2;
enum IOIndex : int32_t
{
    kQ = 0,
    kK = 1,
    kQ_WEIGHT = 2,
    kK_WEIGHT = 3,
    kCACHE = 4,
    kQ_OUT = 5,
    kK_OUT = 6,
};

constexpr float kDEFAULT_EPSILON = 1e-6F;
constexpr int32_t kDEFAULT_INTERLEAVED = 1;
constexpr int32_t kDEFAULT_ROUNDING = 0;

struct QKNormRoPEAttributes
{
    float epsilon{kDEFAULT_EPSILON};
    int32_t interleaved{kDEFAULT_INTERLEAVED};
    int32_t rounding{kDEFAULT_ROUNDING};
};

// Parses a field collection by the rules above. Returns false and sets `error` on a bad field.
bool parseFields(nvinfer1::PluginFieldCollection const* fc, QKNormRoPEAttributes& out, std::string& error) noexcept;

class QKNormRoPEPlugin final : public nvinfer1::IPluginV3,
                               public nvinfer1::IPluginV3OneCore,
                               public nvinfer1::IPluginV3OneBuild,
                               public nvinfer1::IPluginV3OneRuntime
{
public:
    QKNormRoPEPlugin(std::string layerName, QKNormRoPEAttributes const& attrs);
    QKNormRoPEPlugin(QKNormRoPEPlugin const& other);
    QKNormRoPEPlugin& operator=(QKNormRoPEPlugin const&) = delete;
    ~QKNormRoPEPlugin() override = default;

    // IPluginV3
    nvinfer1::IPluginCapability* getCapabilityInterface(nvinfer1::PluginCapabilityType type) noexcept override;
    nvinfer1::IPluginV3* clone() noexcept override;

    // IPluginV3OneCore
    char const* getPluginName() const noexcept override;
    char const* getPluginVersion() const noexcept override;
    char const* getPluginNamespace() const noexcept override;

    // IPluginV3OneBuild
    int32_t configurePlugin(nvinfer1::DynamicPluginTensorDesc const* in, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
    int32_t getOutputDataTypes(nvinfer1::DataType* outputTypes, int32_t nbOutputs,
        nvinfer1::DataType const* inputTypes, int32_t nbInputs) const noexcept override;
    int32_t getOutputShapes(nvinfer1::DimsExprs const* inputs, int32_t nbInputs,
        nvinfer1::DimsExprs const* shapeInputs, int32_t nbShapeInputs, nvinfer1::DimsExprs* outputs,
        int32_t nbOutputs, nvinfer1::IExprBuilder& exprBuilder) noexcept override;
    bool supportsFormatCombination(int32_t pos, nvinfer1::DynamicPluginTensorDesc const* inOut, int32_t nbInputs,
        int32_t nbOutputs) noexcept override;
    int32_t getNbOutputs() const noexcept override;
    size_t getWorkspaceSize(nvinfer1::DynamicPluginTensorDesc const* inputs, int32_t nbInputs,
        nvinfer1::DynamicPluginTensorDesc const* outputs, int32_t nbOutputs) const noexcept override;
    char const* getTimingCacheID() noexcept override;
    char const* getMetadataString() noexcept override;

    // IPluginV3OneRuntime
    int32_t onShapeChange(nvinfer1::PluginTensorDesc const* in, int32_t nbInputs,
        nvinfer1::PluginTensorDesc const* out, int32_t nbOutputs) noexcept override;
    int32_t enqueue(nvinfer1::PluginTensorDesc const* inputDesc, nvinfer1::PluginTensorDesc const* outputDesc,
        void const* const* inputs, void* const* outputs, void* workspace, cudaStream_t stream) noexcept override;
    nvinfer1::IPluginV3* attachToContext(nvinfer1::IPluginResourceContext* context) noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldsToSerialize() noexcept override;

    QKNormRoPEAttributes const& attributes() const noexcept
    {
        return mAttrs;
    }

private:
    void logError(std::string const& msg) const noexcept;

    std::string mLayerName;
    QKNormRoPEAttributes mAttrs;
    std::string mCacheID; // attribute summary: timing-cache ID and metadata string
    std::vector<nvinfer1::PluginField> mSerialFields;
    nvinfer1::PluginFieldCollection mSerialFC{};
};

class QKNormRoPEPluginCreator final : public nvinfer1::IPluginCreatorV3One
{
public:
    QKNormRoPEPluginCreator();
    ~QKNormRoPEPluginCreator() override = default;

    nvinfer1::IPluginV3* createPlugin(
        char const* name, nvinfer1::PluginFieldCollection const* fc, nvinfer1::TensorRTPhase phase) noexcept override;
    nvinfer1::PluginFieldCollection const* getFieldNames() noexcept override;
    char const* getPluginName() const noexcept override;
    char const* getPluginVersion() const noexcept override;
    char const* getPluginNamespace() const noexcept override;

private:
    std::vector<nvinfer1::PluginField> mFields;
    nvinfer1::PluginFieldCollection mFC{};
};

} // namespace plugin
} // namespace qkrope
