// qkrope: TensorRT IPluginV3 adapter for the fused QK-RMSNorm + RoPE kernel.
//
// The node contract (docs/spec.md sections 3-4):
//   name, version, namespace: kPLUGIN_NAME / kPLUGIN_VERSION / kPLUGIN_NAMESPACE (qknorm_rope_fields.h)
//   inputs  q [B,S,H,D], k [B,S,H,D], q_weight [D], k_weight [D], cos_sin_cache [R, rotary_dim] fp32
//   outputs q_out, k_out (same shapes and dtype as q, k)
//   fields  kFIELDS (qknorm_rope_fields.h: name, type, default, valid range, parsing rules)
// Every entry point checks what it receives (field collections, tensor counts, Dims ranks and
// extents, dtypes) before using it, logs one clear message through the TensorRT logger when it
// refuses, and never throws across the ABI (qknorm_rope_check.h).
#pragma once

#include "qknorm_rope.h"
#include "qknorm_rope_fields.h"

#include <NvInferRuntime.h>

#include <cstdint>
#include <string>
#include <vector>

namespace qkrope
{
namespace plugin
{

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
    // Runs an entry point's body: a refusal or an exception is logged as "<where>: <message>" and
    // `failure` returned (see guarded()).
    template <typename R, typename Body>
    R run(char const* where, R failure, Body&& body) const noexcept;

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
