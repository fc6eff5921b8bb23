// qkrope fuzz target: the decoder of plugin field collections (PluginFieldCollection with hostile
// names, types, lengths and data), one heap block per buffer. Overview: plugin_fuzz.cpp.
#include "plugin_fuzz.h"

namespace qkrope_fuzz
{

// ---- field collections ----------------------------------------------------------------------------

size_t elementSize(PluginFieldType t)
{
    switch (t)
    {
    case PluginFieldType::kFLOAT64:
    case PluginFieldType::kINT64: return 8;
    case PluginFieldType::kFLOAT32:
    case PluginFieldType::kINT32: return 4;
    case PluginFieldType::kFLOAT16:
    case PluginFieldType::kBF16:
    case PluginFieldType::kINT16: return 2;
    case PluginFieldType::kDIMS: return sizeof(Dims);
    default: return 1;
    }
}

namespace
{

constexpr int32_t kNB_FIELD_TYPES = 14; // kFLOAT16 (0) .. kFP4 (13) in TensorRT 10.14

} // namespace

std::unique_ptr<char[]> heapString(std::string const& s)
{
    std::unique_ptr<char[]> p(new char[s.size() + 1]);
    std::memcpy(p.get(), s.c_str(), s.size() + 1);
    return p;
}

namespace
{

void setData(FieldStore& f, void const* bytes, size_t n)
{
    f.data.reset(new char[n]);
    if (n != 0)
    {
        std::memcpy(f.data.get(), bytes, n);
    }
    f.dataBytes = n;
}

// An interesting numeric value written as `count` elements of type t.
void numericData(Input& in, FieldStore& f, size_t count, qp::FieldSpec const* spec, bool clean)
{
    static double const kDoubles[] = {1e-6, 1e-5, 0.0, -0.0, 1.0, -1e-6, 1e-300, 1e-45, 1.5e-45, FLT_MIN,
        FLT_MAX, static_cast<double>(FLT_MAX) * 2, 3.4028235677973366e38, std::numeric_limits<double>::infinity(),
        -std::numeric_limits<double>::infinity(), std::nan(""), 1e30, 0.5, 2.0, 1e-38};
    static int64_t const kInts[] = {0, 1, -1, 2, 3, 7, INT8_MIN, INT8_MAX, INT16_MIN, INT16_MAX, INT32_MIN, INT32_MAX,
        int64_t{1} << 32, (int64_t{1} << 32) | 1, INT64_MIN, INT64_MAX, 255, 256};
    size_t const es = elementSize(f.type);
    std::vector<unsigned char> buf(es * count);
    for (size_t i = 0; i < count; ++i)
    {
        unsigned char* at = buf.data() + i * es;
        uint8_t const how = clean ? 0 : in.u8() % 4;
        if (how == 3)
        {
            std::vector<uint8_t> raw = in.bytes(es);
            std::memcpy(at, raw.data(), es);
            continue;
        }
        // how 0: a valid value of the field (its default or a bound), else an interesting one
        bool const valid = how == 0 && spec != nullptr && spec->kind == qp::FieldKind::kATTRIBUTE;
        uint8_t const pick = in.u8();
        double const validValue = !valid ? 0.0
            : pick % 3 == 0             ? spec->defaultValue
            : pick % 3 == 1 ? (spec->minExclusive ? spec->defaultValue : spec->min)
                            : (spec->max >= FLT_MAX ? spec->defaultValue * 10 : spec->max);
        double const d = valid ? validValue : kDoubles[pick % (sizeof(kDoubles) / sizeof(kDoubles[0]))];
        int64_t const v = valid ? static_cast<int64_t>(validValue) : kInts[pick % (sizeof(kInts) / sizeof(kInts[0]))];
        switch (f.type)
        {
        case PluginFieldType::kFLOAT32:
        {
            // narrowed through memcpy of the bit pattern where it does not fit (no UB conversion)
            float x = std::fabs(d) <= FLT_MAX || std::isnan(d) || std::isinf(d) ? static_cast<float>(d) : FLT_MAX;
            std::memcpy(at, &x, 4);
            break;
        }
        case PluginFieldType::kFLOAT64: std::memcpy(at, &d, 8); break;
        case PluginFieldType::kINT64: std::memcpy(at, &v, 8); break;
        case PluginFieldType::kINT32:
        {
            int32_t x = static_cast<int32_t>(static_cast<uint64_t>(v)); // modular, well defined
            std::memcpy(at, &x, 4);
            break;
        }
        case PluginFieldType::kINT16:
        {
            int16_t x = static_cast<int16_t>(static_cast<uint64_t>(v));
            std::memcpy(at, &x, 2);
            break;
        }
        default:
        {
            std::vector<uint8_t> raw = in.bytes(es);
            std::memcpy(at, raw.data(), es);
            if (es == 1)
            {
                at[0] = static_cast<unsigned char>(static_cast<uint64_t>(v));
            }
            break;
        }
        }
    }
    setData(f, buf.data(), buf.size());
}

// A string payload of `count` characters (no NUL added beyond what the choice contains).
std::string stringPayload(Input& in, qp::FieldSpec const* spec, bool clean, bool& countsNul)
{
    static char const* const kStrings[] = {"1", "qkrope", "2", "", "qkrop", "qkrope2", "1.0", "QKROPE", "0"};
    std::string s;
    uint8_t const how = clean ? 0 : in.u8() % 8;
    if (how < 5 && spec != nullptr && spec->kind == qp::FieldKind::kIDENTITY)
    {
        s = spec->identity;
    }
    else if (how < 7)
    {
        s = kStrings[in.below(sizeof(kStrings) / sizeof(kStrings[0]))];
    }
    else
    {
        std::vector<uint8_t> raw = in.bytes(in.below(12));
        s.assign(raw.begin(), raw.end());
    }
    countsNul = in.chance(128);
    if (countsNul)
    {
        s.push_back('\0');
    }
    if (!clean && in.chance(20) && !s.empty())
    {
        s.insert(s.begin() + in.below(static_cast<uint32_t>(s.size())), '\0'); // an embedded NUL
    }
    return s;
}

std::vector<qp::FieldSpec const*> specs()
{
    std::vector<qp::FieldSpec const*> v;
    for (qp::FieldSpec const& s : qp::kFIELDS)
    {
        v.push_back(&s);
    }
    return v;
}


} // namespace

qp::FieldSpec const* specNamed(char const* name)
{
    if (name == nullptr)
    {
        return nullptr;
    }
    for (qp::FieldSpec const& s : qp::kFIELDS)
    {
        if (std::strcmp(s.name, name) == 0)
        {
            return &s;
        }
    }
    return nullptr;
}

namespace
{

// forced: the field's name when not null (the parser's form), else a fuzzed one.
void makeField(Input& in, FieldStore& f, qp::FieldSpec const* forced)
{
    static std::vector<qp::FieldSpec const*> const kSpecs = specs();
    static char const* const kOtherNames[] = {"theta", "Epsilon", "epsilon ", "", "rounding\x01", "plugin_version2",
        "interleave", "eps"};
    // name
    uint8_t const nameChoice = in.u8() % 16;
    qp::FieldSpec const* spec = nullptr;
    if (forced != nullptr && nameChoice < 12)
    {
        spec = forced;
        f.name = heapString(spec->name);
    }
    else if (nameChoice < 11)
    {
        spec = kSpecs[nameChoice % kSpecs.size()];
        f.name = heapString(spec->name);
    }
    else if (nameChoice < 14)
    {
        f.name = heapString(kOtherNames[in.below(sizeof(kOtherNames) / sizeof(kOtherNames[0]))]);
    }
    else if (nameChoice == 14)
    {
        std::vector<uint8_t> raw = in.bytes(in.below(10));
        std::string s(raw.begin(), raw.end());
        f.name = heapString(s.c_str()); // up to its first NUL: a C string, as TensorRT passes
    }
    // nameChoice 15: no name
    // type: mostly the declared one
    // clean: a well-formed field of that name (declared type, its length, data present, mostly a
    // valid value), so that random inputs reach the accepting paths often enough
    bool const clean = spec != nullptr && in.u8() < 150;
    uint8_t const typeChoice = clean ? 0 : in.u8();
    if (spec != nullptr && typeChoice < 160)
    {
        f.type = spec->type;
        if (typeChoice >= 130)
        {
            f.type = spec->type == PluginFieldType::kFLOAT32 ? PluginFieldType::kFLOAT64
                : spec->type == PluginFieldType::kINT32
                ? (typeChoice & 1 ? PluginFieldType::kINT64 : (typeChoice & 2 ? PluginFieldType::kINT16 : PluginFieldType::kINT8))
                : spec->type;
        }
    }
    else
    {
        f.type = static_cast<PluginFieldType>(typeChoice % kNB_FIELD_TYPES);
    }
    // length: mostly 1 (numbers) / the string's length (kCHAR)
    uint8_t const lengthChoice = clean ? 0 : in.u8() % 32;
    bool const isChar = f.type == PluginFieldType::kCHAR;
    std::string payload;
    bool countsNul = false;
    if (isChar)
    {
        payload = stringPayload(in, spec, clean, countsNul);
    }
    int32_t length = isChar ? static_cast<int32_t>(payload.size()) : 1;
    if (lengthChoice >= 24)
    {
        static int32_t const kLengths[] = {0, -1, INT32_MIN, 2, 3, INT32_MAX, -2, 1 << 20};
        length = kLengths[lengthChoice - 24];
    }
    else if (lengthChoice >= 21 && isChar)
    {
        length = static_cast<int32_t>(payload.size()) - static_cast<int32_t>(in.below(3)); // cut short
        if (length < 0)
        {
            length = 0;
        }
    }
    f.length = length;
    bool const nullData = !clean && in.chance(10);
    if (nullData)
    {
        return;
    }
    if (length < 0)
    {
        // A hostile length: a short NUL-less block the plugin must not read at all.
        std::vector<uint8_t> raw = in.bytes(in.below(4));
        for (auto& b : raw)
        {
            b = b ? b : 'x';
        }
        if (isChar && !payload.empty() && in.chance(128))
        {
            raw.assign(payload.begin(), payload.end());
            while (!raw.empty() && raw.back() == '\0')
            {
                raw.pop_back();
            }
        }
        setData(f, raw.data(), raw.size());
        return;
    }
    constexpr int32_t kMAX_ELEMENTS = 64;
    if (isChar)
    {
        // exactly `length` characters; a length past the payload is NUL-padded (a C string) up to 64
        // and, when huge, a NUL-terminated block: the plugin may read up to the NUL only.
        size_t const n = length <= kMAX_ELEMENTS ? static_cast<size_t>(length) : payload.size() + 1;
        std::string block = payload;
        block.resize(n, '\0');
        if (length > kMAX_ELEMENTS)
        {
            block.back() = '\0';
        }
        setData(f, block.data(), block.size());
        return;
    }
    size_t const count = length <= kMAX_ELEMENTS ? static_cast<size_t>(length) : 1;
    if (length > kMAX_ELEMENTS)
    {
        // A huge length over a 1-element block: only a refusal before reading keeps this in bounds.
        numericData(in, f, count, spec, false);
        return;
    }
    numericData(in, f, count, spec, clean);
}

} // namespace

void makeCollection(Input& in, Collection& c)
{
    uint8_t const mode = in.u8() % 32;
    if (mode == 31)
    {
        c.passNull = true;
        return;
    }
    if (mode == 30)
    {
        // malformed: nbFields != 0 with null fields, or a negative count
        c.fc.nbFields = in.chance(128) ? static_cast<int32_t>(in.below(5)) + 1 : -static_cast<int32_t>(in.below(3)) - 1;
        c.fc.fields = nullptr;
        return;
    }
    // mode < 12: the parser's form (every attribute once, in table order), perturbed by the field
    // decoder's choices; else 0..8 fuzzed fields
    std::vector<qp::FieldSpec const*> attributes;
    for (qp::FieldSpec const& s : qp::kFIELDS)
    {
        if (s.kind == qp::FieldKind::kATTRIBUTE)
        {
            attributes.push_back(&s);
        }
    }
    c.fields.resize(mode < 12 ? attributes.size() : static_cast<size_t>(in.below(9)));
    for (size_t i = 0; i < c.fields.size(); ++i)
    {
        makeField(in, c.fields[i], mode < 12 && i < attributes.size() ? attributes[i] : nullptr);
    }
    if (c.fields.empty())
    {
        c.fc.nbFields = 0;
        c.fc.fields = in.chance(128) ? nullptr : reinterpret_cast<PluginField const*>(&c.fc); // never read
        return;
    }
    c.array.reset(new PluginField[c.fields.size()]);
    for (size_t i = 0; i < c.fields.size(); ++i)
    {
        FieldStore const& f = c.fields[i];
        c.array[i] = PluginField(f.name.get(), f.data.get(), f.type, f.length);
    }
    c.fc.nbFields = static_cast<int32_t>(c.fields.size());
    c.fc.fields = c.array.get();
}

} // namespace qkrope_fuzz
