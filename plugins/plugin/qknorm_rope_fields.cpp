// qkrope: parsing, advertising, serialising and summarising the plugin fields, all from kFIELDS.
#include "qknorm_rope_fields.h"

#include "qknorm_rope_check.h"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <type_traits>

namespace qkrope
{
namespace plugin
{

using nvinfer1::PluginField;
using nvinfer1::PluginFieldCollection;
using nvinfer1::PluginFieldType;

namespace
{

static_assert(std::is_standard_layout_v<QKNormRoPEAttributes>, "kFIELDS addresses members by offsetof");
static_assert(sizeof(float) == 4 && sizeof(int32_t) == 4, "kFLOAT32 / kINT32 members are 4 bytes");

constexpr size_t kNB_FIELDS = sizeof(kFIELDS) / sizeof(kFIELDS[0]);

// The ONNX attribute type the parser turns into a field of this type, and the other widths a
// direct caller may use.
char const* onnxTypeName(PluginFieldType t) noexcept
{
    switch (t)
    {
    case PluginFieldType::kFLOAT32: return "FLOAT";
    case PluginFieldType::kINT32: return "INT";
    default: return "STRING";
    }
}

char const* alsoAccepted(PluginFieldType t) noexcept
{
    switch (t)
    {
    case PluginFieldType::kFLOAT32: return "; kFLOAT64 is accepted too";
    case PluginFieldType::kINT32: return "; kINT64/kINT16/kINT8 are accepted too";
    default: return "";
    }
}

bool typeAccepted(PluginFieldType declared, PluginFieldType given) noexcept
{
    switch (declared)
    {
    case PluginFieldType::kFLOAT32: return given == PluginFieldType::kFLOAT32 || given == PluginFieldType::kFLOAT64;
    case PluginFieldType::kINT32:
        return given == PluginFieldType::kINT32 || given == PluginFieldType::kINT64 || given == PluginFieldType::kINT16
            || given == PluginFieldType::kINT8;
    default: return given == declared;
    }
}

std::string number(double v)
{
    char buf[64];
    std::snprintf(buf, sizeof(buf), "%.9g", v);
    return buf;
}

// "> 0", "0 or 1", "in [2, 8]".
std::string rangeText(FieldSpec const& s)
{
    bool const integral = s.type == PluginFieldType::kINT32;
    if (integral && s.max - s.min == 1 && !s.minExclusive)
    {
        return number(s.min) + " or " + number(s.max);
    }
    if (s.max >= FLT_MAX)
    {
        return (s.minExclusive ? "> " : ">= ") + number(s.min);
    }
    return "in " + std::string(s.minExclusive ? "(" : "[") + number(s.min) + ", " + number(s.max)
        + (s.maxExclusive ? ")" : "]");
}

bool inRange(FieldSpec const& s, double v) noexcept
{
    return (s.minExclusive ? v > s.min : v >= s.min) && (s.maxExclusive ? v < s.max : v <= s.max);
}

void* slotOf(QKNormRoPEAttributes& a, FieldSpec const& s) noexcept
{
    return reinterpret_cast<unsigned char*>(&a) + s.offset;
}

void const* slotOf(QKNormRoPEAttributes const& a, FieldSpec const& s) noexcept
{
    return reinterpret_cast<unsigned char const*>(&a) + s.offset;
}

FieldSpec const* findField(char const* name) noexcept
{
    for (FieldSpec const& s : kFIELDS)
    {
        if (std::strcmp(s.name, name) == 0)
        {
            return &s;
        }
    }
    return nullptr;
}

std::string acceptedFields()
{
    std::string list;
    for (FieldSpec const& s : kFIELDS)
    {
        if (s.kind == FieldKind::kATTRIBUTE)
        {
            list += std::string(list.empty() ? "" : ", ") + s.name + " (" + fieldTypeName(s.type) + ")";
        }
    }
    return list;
}

double readNumber(PluginField const& f) noexcept
{
    switch (f.type)
    {
    case PluginFieldType::kFLOAT32: return *static_cast<float const*>(f.data);
    case PluginFieldType::kFLOAT64: return *static_cast<double const*>(f.data);
    case PluginFieldType::kINT64: return static_cast<double>(*static_cast<int64_t const*>(f.data));
    case PluginFieldType::kINT32: return *static_cast<int32_t const*>(f.data);
    case PluginFieldType::kINT16: return *static_cast<int16_t const*>(f.data);
    case PluginFieldType::kINT8: return *static_cast<int8_t const*>(f.data);
    default: return std::nan("");
    }
}

// An attribute's value, checked against its range, stored into `a`.
void readAttribute(FieldSpec const& s, PluginField const& f, QKNormRoPEAttributes& a)
{
    std::string const name = std::string("field '") + s.name + "'";
    QKROPE_VALIDATE(f.length == 1, name + " has length " + std::to_string(f.length) + ", expected 1 (a scalar)");
    if (s.type == PluginFieldType::kFLOAT32)
    {
        double const v = readNumber(f);
        // Narrowed only once known to fit float32; the narrowed value must be in range too (1e-300
        // is > 0 but underflows to 0).
        QKROPE_VALIDATE(std::isfinite(v) && std::fabs(v) <= static_cast<double>(FLT_MAX) && inRange(s, v)
                && inRange(s, static_cast<double>(static_cast<float>(v))),
            name + " = " + number(v) + " is invalid: expected a finite float32 " + rangeText(s) + " (default "
                + number(s.defaultValue) + ", " + s.meaning + ")");
        float const narrowed = static_cast<float>(v);
        std::memcpy(slotOf(a, s), &narrowed, sizeof(narrowed));
        return;
    }
    // kINT32: read the exact integer (an int64 does not fit a double exactly).
    int64_t const v = f.type == PluginFieldType::kINT64 ? *static_cast<int64_t const*>(f.data)
                                                        : static_cast<int64_t>(readNumber(f));
    QKROPE_VALIDATE(inRange(s, static_cast<double>(v)) && v >= INT32_MIN && v <= INT32_MAX,
        name + " = " + std::to_string(v) + " is invalid: expected " + rangeText(s) + " (" + s.meaning + ")");
    int32_t const narrowed = static_cast<int32_t>(v);
    std::memcpy(slotOf(a, s), &narrowed, sizeof(narrowed));
}

// An identity field: a kCHAR of `length` characters, or fewer up to a NUL.
void checkIdentity(FieldSpec const& s, PluginField const& f)
{
    std::string const name = std::string("field '") + s.name + "'";
    QKROPE_VALIDATE(f.length >= 0, name + " has length " + std::to_string(f.length) + ", expected >= 0 (a string)");
    auto const* chars = static_cast<char const*>(f.data);
    size_t n = 0;
    while (n < static_cast<size_t>(f.length) && chars[n] != '\0')
    {
        ++n;
    }
    std::string const v(chars, n);
    QKROPE_VALIDATE(v == s.identity,
        name + " = \"" + v + "\" does not match this plugin (expected \"" + s.identity + "\")");
}

} // namespace

QKNormRoPEAttributes defaultAttributes() noexcept
{
    QKNormRoPEAttributes a{};
    for (FieldSpec const& s : kFIELDS)
    {
        if (s.kind != FieldKind::kATTRIBUTE)
        {
            continue;
        }
        if (s.type == PluginFieldType::kFLOAT32)
        {
            float const v = static_cast<float>(s.defaultValue);
            std::memcpy(slotOf(a, s), &v, sizeof(v));
        }
        else
        {
            int32_t const v = static_cast<int32_t>(s.defaultValue);
            std::memcpy(slotOf(a, s), &v, sizeof(v));
        }
    }
    return a;
}

QKNormRoPEAttributes parseFields(PluginFieldCollection const* fc)
{
    QKNormRoPEAttributes a = defaultAttributes();
    if (fc == nullptr || fc->nbFields == 0)
    {
        return a;
    }
    QKROPE_VALIDATE(fc->nbFields > 0 && fc->fields != nullptr,
        "the PluginFieldCollection is malformed (nbFields = " + std::to_string(fc->nbFields)
            + ", fields = " + (fc->fields ? "set" : "null") + ")");
    bool seen[kNB_FIELDS] = {};
    for (int32_t i = 0; i < fc->nbFields; ++i)
    {
        PluginField const& f = fc->fields[i];
        QKROPE_VALIDATE(f.name != nullptr, "field " + std::to_string(i) + " has no name");
        FieldSpec const* s = findField(f.name);
        QKROPE_VALIDATE(s != nullptr, "unknown field '" + std::string(f.name) + "'; accepted fields: " + acceptedFields());
        std::string const name = std::string("field '") + s->name + "'";
        bool& once = seen[s - kFIELDS];
        QKROPE_VALIDATE(!once, name + " is given twice");
        once = true;
        QKROPE_VALIDATE(f.data != nullptr, name + " has no data");
        QKROPE_VALIDATE(typeAccepted(s->type, f.type),
            name + " has type " + fieldTypeName(f.type) + ", expected " + fieldTypeName(s->type) + " (an ONNX "
                + onnxTypeName(s->type) + " attribute" + alsoAccepted(s->type) + ")");
        if (s->kind == FieldKind::kATTRIBUTE)
        {
            readAttribute(*s, f, a);
        }
        else
        {
            checkIdentity(*s, f);
        }
    }
    return a;
}

std::vector<PluginField> advertisedFields()
{
    std::vector<PluginField> list;
    for (FieldSpec const& s : kFIELDS)
    {
        if (s.kind == FieldKind::kATTRIBUTE)
        {
            list.emplace_back(s.name, nullptr, s.type, 1);
        }
    }
    return list;
}

std::vector<PluginField> serializedFields(QKNormRoPEAttributes& attrs)
{
    std::vector<PluginField> list;
    for (FieldSpec const& s : kFIELDS)
    {
        if (s.kind == FieldKind::kATTRIBUTE)
        {
            list.emplace_back(s.name, slotOf(attrs, s), s.type, 1);
        }
    }
    return list;
}

std::string attributeSummary(QKNormRoPEAttributes const& attrs)
{
    std::string summary;
    for (FieldSpec const& s : kFIELDS)
    {
        if (s.kind != FieldKind::kATTRIBUTE)
        {
            continue;
        }
        summary += std::string(summary.empty() ? "" : ";") + s.name + "=";
        if (s.type == PluginFieldType::kFLOAT32)
        {
            float v;
            std::memcpy(&v, slotOf(attrs, s), sizeof(v));
            summary += number(static_cast<double>(v));
        }
        else
        {
            int32_t v;
            std::memcpy(&v, slotOf(attrs, s), sizeof(v));
            summary += std::to_string(v);
        }
    }
    return summary;
}

std::string exportedFieldsHint()
{
    std::string hint;
    for (FieldSpec const& s : kFIELDS)
    {
        if (s.kind == FieldKind::kATTRIBUTE)
        {
            hint += std::string(hint.empty() ? "" : ", ") + s.name + " (" + onnxTypeName(s.type) + " " + rangeText(s)
                + ")";
        }
    }
    return hint;
}

} // namespace plugin
} // namespace qkrope
