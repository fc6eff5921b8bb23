// qkrope: the QKNormRoPE node's identity and its plugin fields (docs/spec.md section 4). kFIELDS is
// the one description of the fields: getFieldNames, parseFields (createPlugin, both phases),
// getFieldsToSerialize and the attribute summary (timing-cache ID) all read it.
//
// Parsing rules (parseFields):
//   - A missing attribute takes its default (the ONNX parser skips attributes the node lacks).
//   - kFLOAT32 fields: kFLOAT32 (what the parser forwards for a FLOAT attribute) or kFLOAT64
//     (Python/numpy callers); the value, as float32, must be finite and in the field's range.
//   - kINT32 fields: kINT32 (the parser narrows the ONNX int64 to int32), kINT64, kINT16 or kINT8;
//     the value must be in the field's range.
//   - Identity fields (plugin_version, plugin_namespace): not in getFieldNames, so the parser does
//     not forward them, but a caller may pass them as kCHAR (length counting the trailing NUL or
//     not); they must then equal this plugin's version / namespace.
//   - Numeric fields have length 1, strings a length >= 0, and every field non-null data. Any other
//     name, a duplicate, a wrong type or length or an out-of-range value is refused (PluginError
//     naming the field): createPlugin logs it and returns nullptr.
#pragma once

#include <NvInferRuntime.h>

#include <cfloat>
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace qkrope
{
namespace plugin
{

// A PluginFieldType's enumerator name ("kFLOAT32"), for messages.
inline char const* fieldTypeName(nvinfer1::PluginFieldType t) noexcept
{
    switch (t)
    {
    case nvinfer1::PluginFieldType::kFLOAT16: return "kFLOAT16";
    case nvinfer1::PluginFieldType::kFLOAT32: return "kFLOAT32";
    case nvinfer1::PluginFieldType::kFLOAT64: return "kFLOAT64";
    case nvinfer1::PluginFieldType::kINT8: return "kINT8";
    case nvinfer1::PluginFieldType::kINT16: return "kINT16";
    case nvinfer1::PluginFieldType::kINT32: return "kINT32";
    case nvinfer1::PluginFieldType::kCHAR: return "kCHAR";
    case nvinfer1::PluginFieldType::kDIMS: return "kDIMS";
    case nvinfer1::PluginFieldType::kUNKNOWN: return "kUNKNOWN";
    case nvinfer1::PluginFieldType::kBF16: return "kBF16";
    case nvinfer1::PluginFieldType::kINT64: return "kINT64";
    default: break;
    }
    return "an unsupported PluginFieldType";
}

constexpr char const* kPLUGIN_NAME = "QKNormRoPE";
constexpr char const* kPLUGIN_VERSION = "1";
constexpr char const* kPLUGIN_NAMESPACE = "qkrope";

// The node's attributes; default values come from kFIELDS (defaultAttributes()).
struct QKNormRoPEAttributes
{
    float epsilon;
    int32_t interleaved;
    int32_t rounding;
    int32_t normScope;
};

enum class FieldKind : int32_t
{
    kATTRIBUTE = 0, // advertised by getFieldNames, parsed into QKNormRoPEAttributes, serialised
    kIDENTITY = 1,  // kCHAR, accepted when given, must equal `identity`; neither advertised nor serialised
};

// An attribute's valid range: [min, max], either end open.
struct FieldRange
{
    double min;
    double max;
    bool minExclusive;
    bool maxExclusive;

    static constexpr FieldRange closed(double lo, double hi) noexcept { return {lo, hi, false, false}; } // lo <= v <= hi
    static constexpr FieldRange open(double lo, double hi) noexcept { return {lo, hi, true, true}; }      // lo < v < hi
};

// An attribute's value when the node does not give it.
struct FieldDefault
{
    double value;
};

// One row of kFIELDS, made by the named constructor of its kind (floatAttribute, intAttribute,
// identityField), so that a row names what each of its values is.
struct FieldSpec
{
    char const* name;
    FieldKind kind;
    nvinfer1::PluginFieldType type; // kFLOAT32 (member float), kINT32 (member int32_t) or kCHAR (identity)
    double defaultValue;            // attributes: the value of a missing field
    double min;                     // attributes: valid range, [min, max] or (min, max] when minExclusive
    bool minExclusive;
    double max;
    size_t offset;        // attributes: offsetof(QKNormRoPEAttributes, member)
    char const* identity; // identity fields: the only accepted value
    char const* meaning;  // what the values mean, appended to an out-of-range message
    bool maxExclusive = false; // attributes: the range is [min, max) / (min, max)

    // A float member at `offset`: an ONNX FLOAT attribute, a kFLOAT32 field.
    static constexpr FieldSpec floatAttribute(char const* name, size_t offset, FieldDefault byDefault,
        FieldRange range, char const* meaning) noexcept
    {
        return attribute(name, nvinfer1::PluginFieldType::kFLOAT32, offset, byDefault, range, meaning);
    }

    // An int32_t member at `offset`: an ONNX INT attribute, a kINT32 field.
    static constexpr FieldSpec intAttribute(char const* name, size_t offset, FieldDefault byDefault,
        FieldRange range, char const* meaning) noexcept
    {
        return attribute(name, nvinfer1::PluginFieldType::kINT32, offset, byDefault, range, meaning);
    }

    // A kCHAR field accepted only when it equals `value`; neither advertised nor serialised.
    static constexpr FieldSpec identityField(char const* name, char const* value) noexcept
    {
        return {name, FieldKind::kIDENTITY, nvinfer1::PluginFieldType::kCHAR, 0, 0, false, 0, 0, value, nullptr};
    }

private:
    static constexpr FieldSpec attribute(char const* name, nvinfer1::PluginFieldType type, size_t offset,
        FieldDefault byDefault, FieldRange range, char const* meaning) noexcept
    {
        return {name, FieldKind::kATTRIBUTE, type, byDefault.value, range.min, range.minExclusive, range.max, offset,
            nullptr, meaning, range.maxExclusive};
    }
};

inline constexpr FieldSpec kFIELDS[] = {
    // The contract's one epsilon rule (qkrope/contract.py, epsilon_error): finite, 0 < eps < 1, checked
    // on the value and on its float32 narrowing (readAttribute); checkParams in
    // plugins/kernel/qknorm_rope_check.cpp says the same.
    FieldSpec::floatAttribute("epsilon", offsetof(QKNormRoPEAttributes, epsilon), FieldDefault{1e-6},
        FieldRange::open(0.0, 1.0), "Qwen-Image uses 1e-6"),
    FieldSpec::intAttribute("interleaved", offsetof(QKNormRoPEAttributes, interleaved), FieldDefault{1},
        FieldRange::closed(0, 1), "1: interleaved pairs (2j, 2j+1) as in Qwen-Image/GPT-J; 0: NeoX halves"),
    FieldSpec::intAttribute("rounding", offsetof(QKNormRoPEAttributes, rounding), FieldDefault{0},
        FieldRange::closed(0, 2),
        "0: one rounding at the end; 1: diffusers' eager order (Qwen-Image); 2: FLUX's eager order"),
    // Added after version 1's first engines: an engine serialised without it parses it as missing,
    // which is its default, 0 (the per-head norm those engines were built with).
    FieldSpec::intAttribute("norm_scope", offsetof(QKNormRoPEAttributes, normScope), FieldDefault{0},
        FieldRange::closed(0, 1),
        "0: RMSNorm over each head's head_dim values; 1: over the token's num_heads * head_dim values (Wan)"),
    FieldSpec::identityField("plugin_version", kPLUGIN_VERSION),
    FieldSpec::identityField("plugin_namespace", kPLUGIN_NAMESPACE),
};

// The attributes of a node that gives no fields.
QKNormRoPEAttributes defaultAttributes() noexcept;

// Parses a field collection by the rules above; throws PluginError naming the bad field.
QKNormRoPEAttributes parseFields(nvinfer1::PluginFieldCollection const* fc);

// The attribute fields, in table order, with data null (getFieldNames) or pointing into `attrs`
// (getFieldsToSerialize; valid while `attrs` lives).
std::vector<nvinfer1::PluginField> advertisedFields();
std::vector<nvinfer1::PluginField> serializedFields(QKNormRoPEAttributes& attrs);

// "epsilon=1e-06;interleaved=1;rounding=0": every attribute, in table order (timing-cache ID and
// metadata string).
std::string attributeSummary(QKNormRoPEAttributes const& attrs);

// What the exporter writes, for error messages: "epsilon (FLOAT in (0, 1)), interleaved (INT 0 or 1), ...".
std::string exportedFieldsHint();

} // namespace plugin
} // namespace qkrope
