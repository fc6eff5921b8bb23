// qkrope fuzz target: the reference model of the plugin's field parsing rules (qknorm_rope_fields.h),
// what createPlugin must accept and with which attributes. Overview: plugin_fuzz.cpp.
#include "plugin_fuzz.h"

namespace qkrope_fuzz
{

// ---- the reference model of the parsing rules (qknorm_rope_fields.h) --------------------------------

namespace
{

bool typeAccepted(PluginFieldType declared, PluginFieldType given)
{
    if (declared == PluginFieldType::kFLOAT32)
    {
        return given == PluginFieldType::kFLOAT32 || given == PluginFieldType::kFLOAT64;
    }
    if (declared == PluginFieldType::kINT32)
    {
        return given == PluginFieldType::kINT32 || given == PluginFieldType::kINT64 || given == PluginFieldType::kINT16
            || given == PluginFieldType::kINT8;
    }
    return given == declared;
}

bool inRange(qp::FieldSpec const& s, double v)
{
    return (s.minExclusive ? v > s.min : v >= s.min) && (s.maxExclusive ? v < s.max : v <= s.max);
}


} // namespace

Expected model(Collection const& c)
{
    Expected e;
    e.attrs = qp::defaultAttributes();
    if (c.passNull || c.fc.nbFields == 0)
    {
        e.accept = true;
        return e;
    }
    if (c.fc.nbFields < 0 || c.fc.fields == nullptr)
    {
        e.why = "malformed collection";
        return e;
    }
    bool seen[sizeof(qp::kFIELDS) / sizeof(qp::kFIELDS[0])] = {};
    for (FieldStore const& f : c.fields)
    {
        qp::FieldSpec const* s = specNamed(f.name.get());
        if (f.name == nullptr || s == nullptr)
        {
            e.why = "no/unknown name";
            return e;
        }
        if (seen[s - qp::kFIELDS])
        {
            e.why = std::string("duplicate ") + s->name;
            return e;
        }
        seen[s - qp::kFIELDS] = true;
        if (f.data == nullptr || !typeAccepted(s->type, f.type))
        {
            e.why = std::string("null data or wrong type: ") + s->name;
            return e;
        }
        if (s->kind == qp::FieldKind::kIDENTITY)
        {
            if (f.length < 0)
            {
                e.why = std::string("negative length: ") + s->name;
                return e;
            }
            std::string v;
            for (int32_t i = 0; i < f.length && f.data[i] != '\0'; ++i)
            {
                v.push_back(f.data[i]);
            }
            if (v != s->identity)
            {
                e.why = std::string("identity mismatch: ") + s->name;
                return e;
            }
            continue;
        }
        if (f.length != 1)
        {
            e.why = std::string("length: ") + s->name;
            return e;
        }
        unsigned char* slot = reinterpret_cast<unsigned char*>(&e.attrs) + s->offset;
        if (s->type == PluginFieldType::kFLOAT32)
        {
            double v;
            if (f.type == PluginFieldType::kFLOAT32)
            {
                float x;
                std::memcpy(&x, f.data.get(), 4);
                v = x;
            }
            else
            {
                std::memcpy(&v, f.data.get(), 8);
            }
            if (!(std::isfinite(v) && std::fabs(v) <= FLT_MAX && inRange(*s, v)
                    && inRange(*s, static_cast<double>(static_cast<float>(v)))))
            {
                e.why = std::string("range: ") + s->name;
                return e;
            }
            float const narrowed = static_cast<float>(v);
            std::memcpy(slot, &narrowed, 4);
            continue;
        }
        int64_t v = 0;
        switch (f.type)
        {
        case PluginFieldType::kINT64: std::memcpy(&v, f.data.get(), 8); break;
        case PluginFieldType::kINT32:
        {
            int32_t x;
            std::memcpy(&x, f.data.get(), 4);
            v = x;
            break;
        }
        case PluginFieldType::kINT16:
        {
            int16_t x;
            std::memcpy(&x, f.data.get(), 2);
            v = x;
            break;
        }
        default:
        {
            int8_t x;
            std::memcpy(&x, f.data.get(), 1);
            v = x;
            break;
        }
        }
        if (!(v >= INT32_MIN && v <= INT32_MAX && inRange(*s, static_cast<double>(v))))
        {
            e.why = std::string("range: ") + s->name;
            return e;
        }
        int32_t const narrowed = static_cast<int32_t>(v);
        std::memcpy(slot, &narrowed, 4);
    }
    e.accept = true;
    return e;
}

bool sameAttrs(qp::QKNormRoPEAttributes const& a, qp::QKNormRoPEAttributes const& b)
{
    return std::memcmp(&a.epsilon, &b.epsilon, sizeof(float)) == 0 && a.interleaved == b.interleaved
        && a.rounding == b.rounding && a.normScope == b.normScope;
}

std::string attrsText(qp::QKNormRoPEAttributes const& a)
{
    return qp::attributeSummary(a);
}

} // namespace qkrope_fuzz
