// qkrope: fuzz target for the QKNormRoPE plugin creator, its field parsing and deserialisation, and
// the IPluginV3 entry points that take tensor descriptors. One source, two drivers:
//
//   libFuzzer  (clang++ -fsanitize=fuzzer,address,undefined, QKROPE_FUZZ_LIBFUZZER=1):
//              LLVMFuzzerTestOneInput; run as `qkrope_plugin_fuzz -runs=N CORPUS_DIR`.
//   seeded loop (any compiler, -fsanitize=address,undefined): `qkrope_plugin_fuzz --iterations N
//              --seed S [--max-len L] [--write-seeds DIR]` feeds N pseudo-random inputs (mt19937_64)
//              to the same function; `qkrope_plugin_fuzz FILE...` replays inputs (libFuzzer
//              artifacts too). A failing iteration prints its seed/index and writes the input to
//              ./qkrope-fuzz-crash-<seed>-<i> before aborting.
//
// The plugin sources (qknorm_rope_plugin.cpp, _fields.cpp, _trt_runtime.cpp, _plugin_entry.cpp with
// QKROPE_VC_PLUGIN=1, and the kernel's qknorm_rope_check.cpp) are compiled INTO this binary with the
// sanitizers (plugins/tests/fuzz/CMakeLists.txt). The CUDA kernel is left out: this file defines
// qkrope::launchQKNormRoPE as a stub that validates the parameters with the real checkParams,
// records them, and returns checkParams' status without launching anything (no GPU, no nvcc, no
// cudart); the plugin's enqueue still runs all of its checks. The CUDA headers are not needed:
// fuzz/cuda_stub/cuda_runtime_api.h declares the two handle types TensorRT's headers use.
//
// The fuzzer calls the plugin only the way TensorRT may (the stand-ins are fake_tensorrt_host.h):
//   - createPlugin(name, PluginFieldCollection, kBUILD|kRUNTIME) with fields of any PluginFieldType
//     value, hostile values and lengths (0, negative, INT32_MIN, > 1, huge), null data, missing,
//     duplicated, unknown and null names, NUL-less strings. Every data buffer is its own heap block
//     of exactly `length` elements (any access past it is an ASan report); a negative length gets a
//     short NUL-less block, which the plugin must refuse without reading;
//   - the serialisation round trip getFieldsToSerialize -> copy (as TensorRT copies into a plan) ->
//     createPlugin(kRUNTIME), clone, attachToContext, and deleting the source first;
//   - getOutputShapes (FakeExprBuilder: constant or symbolic extents), supportsFormatCombination,
//     getOutputDataTypes, configurePlugin, onShapeChange and enqueue with fuzzed Dims (nbDims -1..9,
//     extents negative / -1 / 0 / huge / near a valid shape), DataType and TensorFormat values, and
//     tensor counts; input and output arrays are exactly as long as the counts given.
// Invariants checked (a violation prints "qkrope-fuzz: INVARIANT VIOLATED ..." and aborts):
//   - no crash and no sanitizer report (ASan/UBSan abort: -fno-sanitize-recover=all);
//   - createPlugin accepts exactly what the documented parsing rules (qknorm_rope_fields.h, ranges
//     from kFIELDS) accept, with those values; a refusal returns nullptr and logs exactly one error
//     naming the plugin (and the layer when named); an acceptance logs nothing;
//   - an accepted plugin serialises to the attribute fields of kFIELDS (length 1, its values), which
//     recreate an equal plugin (same fields, timing-cache ID); clones and attached plugins are equal
//     and independent;
//   - each int32_t entry point returns 0 or its documented failure value (1; enqueue: the
//     qkrope::Status of the refusal) exactly when a reference model of the documented shape/dtype
//     rules says so, logging one error on refusal and none on success; supportsFormatCombination
//     agrees with its model; enqueue launches (the stub) only when it returns 0 on a non-empty
//     problem, with the parameters the descriptors and attributes give.
#include "fake_tensorrt_host.h"

#include "qknorm_rope.h"
#include "qknorm_rope_fields.h"

#include <NvInferRuntime.h>

#include <cfloat>
#include <cinttypes>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

using namespace nvinfer1;
namespace qp = qkrope::plugin;

// The version-compatible entry points (qknorm_rope_plugin_entry.cpp, QKROPE_VC_PLUGIN=1), compiled in.
extern "C" IPluginCreatorInterface* const* getCreators(int32_t& nbCreators);
extern "C" void setLoggerFinder(ILoggerFinder* finder);

// ---- the launch stub ------------------------------------------------------------------------------

namespace
{
struct LaunchRecord
{
    int calls{0};
    qkrope::QKNormRoPEParams params{};
    qkrope::Status status{qkrope::Status::kSUCCESS};
};
LaunchRecord gLaunch;
} // namespace

namespace qkrope
{
// Stands in for the CUDA launcher (qknorm_rope.cu): the same contract (checkParams first, its status
// returned when it fails), no kernel. Records what it was given.
Status launchQKNormRoPE(QKNormRoPEParams const& p, cudaStream_t /*stream*/) noexcept
{
    ++gLaunch.calls;
    gLaunch.params = p;
    gLaunch.status = checkParams(p);
    return gLaunch.status;
}
} // namespace qkrope

namespace
{

// ---- failure reporting ----------------------------------------------------------------------------

std::string gContext; // what the current iteration is doing, for the report

[[noreturn]] void violated(std::string const& what)
{
    std::fprintf(stderr, "qkrope-fuzz: INVARIANT VIOLATED during %s: %s\n", gContext.c_str(), what.c_str());
    std::fflush(stderr);
    std::abort();
}

#define FUZZ_CHECK(cond, msg)                                                                                          \
    do                                                                                                                 \
    {                                                                                                                  \
        if (!(cond))                                                                                                   \
        {                                                                                                              \
            violated(std::string(#cond) + ": " + (msg));                                                               \
        }                                                                                                              \
    } while (0)

// What the inputs reached, printed by the seeded loop ("STATS ...") and checked by the test.
struct Stats
{
    uint64_t created, refused, roundTrips, formats, types[2], shapes[2], configure[2], enqueue[2], launches;
};
Stats gStats{};

qkrope_test::RecordingLogger gLogger;
qkrope_test::FixedLoggerFinder gFinder{gLogger};

// Every message since `mark` is one error that names the plugin (and `layer` unless empty).
void expectOneError(size_t mark, std::string const& layer, char const* where)
{
    size_t const n = gLogger.messages.size() - mark;
    std::string const last = gLogger.lastSince(mark);
    FUZZ_CHECK(n == 1 && gLogger.errorsSince(mark) == 1,
        std::string(where) + ": expected exactly one logged error, got " + std::to_string(n) + " messages; last: " + last);
    FUZZ_CHECK(last.find("QKNormRoPE") != std::string::npos && (layer.empty() || last.find(layer) != std::string::npos),
        std::string(where) + ": the message does not name the plugin/layer '" + layer + "': " + last);
}

void expectSilence(size_t mark, char const* where)
{
    FUZZ_CHECK(gLogger.messages.size() == mark,
        std::string(where) + ": succeeded but logged: " + gLogger.lastSince(mark));
}

// ---- input decoding -------------------------------------------------------------------------------

// Reads choices from the fuzz input; past its end every read is 0, and 0 always decodes to the
// common, valid choice, so short inputs exercise the accepting paths.
class Input
{
public:
    Input(uint8_t const* data, size_t size)
        : mData(data)
        , mSize(size)
    {
    }
    uint8_t u8()
    {
        return mPos < mSize ? mData[mPos++] : 0;
    }
    uint32_t u32()
    {
        uint32_t v = 0;
        for (int i = 0; i < 4; ++i)
        {
            v = v << 8 | u8();
        }
        return v;
    }
    uint64_t u64()
    {
        return static_cast<uint64_t>(u32()) << 32 | u32();
    }
    // A value in [0, n).
    uint32_t below(uint32_t n)
    {
        return n <= 256 ? u8() % n : u32() % n;
    }
    // True with probability about num/256 (false once the input is exhausted).
    bool chance(uint32_t num)
    {
        return mPos < mSize && u8() < num;
    }
    std::vector<uint8_t> bytes(size_t n)
    {
        std::vector<uint8_t> v(n);
        for (auto& b : v)
        {
            b = u8();
        }
        return v;
    }

private:
    uint8_t const* mData;
    size_t mSize;
    size_t mPos{0};
};

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

constexpr int32_t kNB_FIELD_TYPES = 14; // kFLOAT16 (0) .. kFP4 (13) in TensorRT 10.14

// One field's storage: name and data are separate heap blocks of exactly their size.
struct FieldStore
{
    std::unique_ptr<char[]> name; // null: a field without a name
    std::unique_ptr<char[]> data; // null: a field without data
    size_t dataBytes{0};
    PluginFieldType type{PluginFieldType::kUNKNOWN};
    int32_t length{0};
};

struct Collection
{
    std::vector<FieldStore> fields;
    std::unique_ptr<PluginField[]> array; // exactly nbFields entries (or null)
    PluginFieldCollection fc{};
    bool passNull{false}; // createPlugin(name, nullptr, phase)
};

std::unique_ptr<char[]> heapString(std::string const& s)
{
    std::unique_ptr<char[]> p(new char[s.size() + 1]);
    std::memcpy(p.get(), s.c_str(), s.size() + 1);
    return p;
}

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
    static int64_t const kInts[] = {0, 1, -1, 2, 7, INT8_MIN, INT8_MAX, INT16_MIN, INT16_MAX, INT32_MIN, INT32_MAX,
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
    c.fields.resize(mode < 12 ? 3 : static_cast<size_t>(in.below(9)));
    std::vector<qp::FieldSpec const*> attributes;
    for (qp::FieldSpec const& s : qp::kFIELDS)
    {
        if (s.kind == qp::FieldKind::kATTRIBUTE)
        {
            attributes.push_back(&s);
        }
    }
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

// ---- the reference model of the parsing rules (qknorm_rope_fields.h) --------------------------------

struct Expected
{
    bool accept{false};
    qp::QKNormRoPEAttributes attrs{};
    std::string why;
};

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
        && a.rounding == b.rounding;
}

std::string attrsText(qp::QKNormRoPEAttributes const& a)
{
    return qp::attributeSummary(a);
}

// ---- plugin views ---------------------------------------------------------------------------------

using PluginPtr = std::unique_ptr<IPluginV3>;

IPluginV3OneCore* coreOf(IPluginV3* p)
{
    return static_cast<IPluginV3OneCore*>(p->getCapabilityInterface(PluginCapabilityType::kCORE));
}
IPluginV3OneBuild* buildOf(IPluginV3* p)
{
    return static_cast<IPluginV3OneBuild*>(p->getCapabilityInterface(PluginCapabilityType::kBUILD));
}
IPluginV3OneRuntime* runtimeOf(IPluginV3* p)
{
    return static_cast<IPluginV3OneRuntime*>(p->getCapabilityInterface(PluginCapabilityType::kRUNTIME));
}

// The attributes a plugin serialises, checked to be exactly the attribute fields of kFIELDS.
qp::QKNormRoPEAttributes serialized(IPluginV3* p, char const* where)
{
    PluginFieldCollection const* fc = runtimeOf(p)->getFieldsToSerialize();
    FUZZ_CHECK(fc != nullptr, std::string(where) + ": getFieldsToSerialize returned null");
    qp::QKNormRoPEAttributes a{};
    int32_t i = 0;
    for (qp::FieldSpec const& s : qp::kFIELDS)
    {
        if (s.kind != qp::FieldKind::kATTRIBUTE)
        {
            continue;
        }
        FUZZ_CHECK(i < fc->nbFields, std::string(where) + ": too few serialised fields");
        PluginField const& f = fc->fields[i++];
        FUZZ_CHECK(f.name != nullptr && std::strcmp(f.name, s.name) == 0 && f.type == s.type && f.length == 1
                && f.data != nullptr,
            std::string(where) + ": serialised field " + std::to_string(i - 1) + " is not " + s.name);
        std::memcpy(reinterpret_cast<unsigned char*>(&a) + s.offset, f.data, 4);
    }
    FUZZ_CHECK(i == fc->nbFields, std::string(where) + ": extra serialised fields");
    return a;
}

IPluginCreatorV3One* gCreator = nullptr;

// The serialised fields copied the way TensorRT copies them into a plan, then recreated (kRUNTIME).
PluginPtr recreate(IPluginV3* p, std::string const& layer)
{
    PluginFieldCollection const* fc = runtimeOf(p)->getFieldsToSerialize();
    FUZZ_CHECK(fc != nullptr && fc->nbFields >= 0, "getFieldsToSerialize");
    std::vector<std::unique_ptr<char[]>> blocks;
    std::vector<std::unique_ptr<char[]>> names;
    std::unique_ptr<PluginField[]> fields(new PluginField[fc->nbFields > 0 ? fc->nbFields : 1]);
    for (int32_t i = 0; i < fc->nbFields; ++i)
    {
        PluginField const& f = fc->fields[i];
        size_t const n = elementSize(f.type) * static_cast<size_t>(f.length);
        blocks.emplace_back(new char[n]);
        std::memcpy(blocks.back().get(), f.data, n);
        names.push_back(heapString(f.name));
        fields[i] = PluginField(names.back().get(), blocks.back().get(), f.type, f.length);
    }
    PluginFieldCollection copy{};
    copy.nbFields = fc->nbFields;
    copy.fields = fields.get();
    size_t const mark = gLogger.mark();
    PluginPtr r(gCreator->createPlugin(layer.c_str(), &copy, TensorRTPhase::kRUNTIME));
    FUZZ_CHECK(r != nullptr, "the serialised fields of an accepted plugin are refused: " + gLogger.lastSince(mark));
    expectSilence(mark, "recreate");
    return r;
}

// ---- tensor descriptors -----------------------------------------------------------------------------

struct Problem
{
    int64_t batch, seq, heads, headDim, rows, rot;
};

Problem makeProblem(Input& in)
{
    Problem p;
    p.batch = in.below(4);          // 0..3 (0: empty)
    p.seq = 1 + in.below(8);
    p.heads = 1 + in.below(4);
    p.headDim = 2 * (1 + in.below(8)) * (in.chance(64) ? 16 : 1); // even; up to 256
    p.rot = 2 * (1 + in.below(static_cast<uint32_t>(p.headDim / 2)));
    p.rows = p.seq + in.below(4);
    if (p.batch == 0 && !in.chance(40))
    {
        p.batch = 1;
    }
    return p;
}

int64_t hostileExtent(Input& in, int64_t near)
{
    static int64_t const kValues[] = {-1, 0, 1, -2, 2, 3, 513, 514, 512, 1023, INT32_MAX, int64_t{1} << 31,
        int64_t{1} << 40, int64_t{1} << 62, INT64_MAX, INT64_MIN, INT64_MIN + 1, -1000};
    uint8_t const how = in.u8() % 4;
    if (how < 2)
    {
        return static_cast<int64_t>(static_cast<uint64_t>(near) + (how == 0 ? 1 : UINT64_MAX)); // +-1, wrapping
    }
    if (how == 2)
    {
        return static_cast<int64_t>(in.u64());
    }
    return kValues[in.below(sizeof(kValues) / sizeof(kValues[0]))];
}

// q, k, q_weight, k_weight, cos_sin_cache, q_out, k_out: a valid problem, then perturbed.
void makeDims(Input& in, Problem const& p, Dims (&d)[7], bool allowWildcards)
{
    std::vector<int64_t> const shapes[7] = {{p.batch, p.seq, p.heads, p.headDim}, {p.batch, p.seq, p.heads, p.headDim},
        {p.headDim}, {p.headDim}, {p.rows, p.rot}, {p.batch, p.seq, p.heads, p.headDim},
        {p.batch, p.seq, p.heads, p.headDim}};
    for (int t = 0; t < 7; ++t)
    {
        d[t] = Dims{};
        d[t].nbDims = static_cast<int32_t>(shapes[t].size());
        for (int j = 0; j < Dims::MAX_DIMS; ++j)
        {
            d[t].d[j] = j < d[t].nbDims ? shapes[t][static_cast<size_t>(j)] : 0;
        }
    }
    int const perturbations = in.chance(100) ? 0 : 1 + static_cast<int>(in.below(3));
    for (int i = 0; i < perturbations; ++i)
    {
        Dims& x = d[in.below(7)];
        uint8_t const what = in.u8() % 8;
        if (what == 0)
        {
            // a rank TensorRT never produces, or another valid rank (extents beyond the old rank: 1)
            static int32_t const kRanks[] = {-1, 9, 0, 1, 2, 3, 4, 5, 8, INT32_MIN, INT32_MAX, -2};
            int32_t const r = kRanks[in.below(sizeof(kRanks) / sizeof(kRanks[0]))];
            for (int32_t j = x.nbDims < 0 ? 0 : x.nbDims; j < Dims::MAX_DIMS; ++j)
            {
                x.d[j] = 1;
            }
            x.nbDims = r;
        }
        else if (x.nbDims > 0 && x.nbDims <= Dims::MAX_DIMS)
        {
            int32_t const j = static_cast<int32_t>(in.below(static_cast<uint32_t>(x.nbDims)));
            x.d[j] = (allowWildcards && what == 1) ? -1 : hostileExtent(in, x.d[j]);
        }
    }
    if (allowWildcards && in.chance(60))
    {
        // dynamic batch / sequence (and cache rows), as a build-time descriptor has them
        for (int t : {0, 1, 5, 6})
        {
            if (d[t].nbDims == 4)
            {
                d[t].d[0] = -1;
                d[t].d[1] = in.chance(128) ? -1 : d[t].d[1];
            }
        }
        if (d[4].nbDims == 2 && in.chance(128))
        {
            d[4].d[0] = -1;
        }
    }
}

DataType pickType(Input& in)
{
    static DataType const kCommon[] = {DataType::kHALF, DataType::kBF16, DataType::kFLOAT};
    if (in.chance(220) || !in.chance(255))
    {
        return kCommon[in.below(3)];
    }
    return static_cast<DataType>(in.below(static_cast<uint32_t>(EnumMax<DataType>())));
}

void makeTypes(Input& in, DataType (&t)[7])
{
    DataType const act = pickType(in);
    for (int i = 0; i < 7; ++i)
    {
        t[i] = i == 4 ? DataType::kFLOAT : act;
    }
    if (in.chance(64))
    {
        t[in.below(7)] = pickType(in);
    }
}

TensorFormat pickFormat(Input& in)
{
    return in.chance(235) || !in.chance(255)
        ? TensorFormat::kLINEAR
        : static_cast<TensorFormat>(in.below(static_cast<uint32_t>(EnumMax<TensorFormat>())));
}

// ---- the reference model of the shape and dtype rules (qknorm_rope_plugin.h) ---------------------

bool validRank(int32_t r)
{
    return r >= 0 && r <= Dims::MAX_DIMS;
}

// Build-time and run-time shape consistency of the five inputs (extents < 0: unknown).
bool shapesConsistent(Dims const* d)
{
    static int32_t const kRanks[5] = {4, 4, 1, 1, 2};
    for (int i = 0; i < 5; ++i)
    {
        if (d[i].nbDims != kRanks[i])
        {
            return false;
        }
    }
    auto known = [](int64_t v) { return v >= 0; };
    for (int j = 0; j < 4; ++j)
    {
        if (known(d[0].d[j]) && known(d[1].d[j]) && d[0].d[j] != d[1].d[j])
        {
            return false;
        }
    }
    int64_t const head = known(d[0].d[3]) ? d[0].d[3] : d[1].d[3];
    int64_t const seq = known(d[0].d[1]) ? d[0].d[1] : d[1].d[1];
    if (known(head) && (head <= 0 || head % 2 != 0 || head > qkrope::kMAX_HEAD_DIM))
    {
        return false;
    }
    for (int w : {2, 3})
    {
        if (known(head) && known(d[w].d[0]) && d[w].d[0] != head)
        {
            return false;
        }
    }
    int64_t const rows = d[4].d[0];
    int64_t const rot = d[4].d[1];
    if (known(rot) && (rot <= 0 || rot % 2 != 0 || (known(head) && rot > head)))
    {
        return false;
    }
    return !(known(rows) && known(seq) && rows < seq);
}

bool isActivation(DataType t)
{
    return t == DataType::kFLOAT || t == DataType::kHALF || t == DataType::kBF16;
}

// ---- the per-plugin checks ------------------------------------------------------------------------

template <typename T>
std::unique_ptr<T[]> exactArray(int32_t n)
{
    return std::unique_ptr<T[]>(new T[n > 0 ? static_cast<size_t>(n) : 0]());
}

void counts(Input& in, int32_t& nbIn, int32_t& nbOut)
{
    nbIn = 5;
    nbOut = 2;
    if (in.chance(24))
    {
        nbIn = static_cast<int32_t>(in.below(8));
        nbOut = static_cast<int32_t>(in.below(4));
    }
}

void fuzzFormats(Input& in, IPluginV3OneBuild* build, Dims const (&d)[7], DataType const (&t)[7])
{
    int32_t nbIn, nbOut;
    counts(in, nbIn, nbOut);
    int32_t const total = nbIn + nbOut;
    auto inOut = exactArray<DynamicPluginTensorDesc>(total);
    for (int32_t i = 0; i < total; ++i)
    {
        inOut[i].desc.dims = d[i % 7];
        inOut[i].desc.type = t[i % 7];
        inOut[i].desc.format = pickFormat(in);
        inOut[i].min = inOut[i].opt = inOut[i].max = d[i % 7];
    }
    int32_t const pos = static_cast<int32_t>(in.below(10)) - 1; // -1..8
    // TensorRT asks for pos in [0, nbInputs + nbOutputs) only.
    if (pos < 0 || pos >= total)
    {
        return;
    }
    size_t const mark = gLogger.mark();
    bool const got = build->supportsFormatCombination(pos, inOut.get(), nbIn, nbOut);
    expectSilence(mark, "supportsFormatCombination");
    bool want = nbIn == 5 && nbOut == 2 && inOut[pos].desc.format == TensorFormat::kLINEAR;
    if (want)
    {
        DataType const ty = inOut[pos].desc.type;
        want = pos == 0 ? isActivation(ty) : pos == 4 ? ty == DataType::kFLOAT : ty == inOut[0].desc.type;
    }
    ++gStats.formats;
    FUZZ_CHECK(got == want, "supportsFormatCombination(pos " + std::to_string(pos) + ") = " + std::to_string(got));
}

void fuzzOutputTypes(Input& in, IPluginV3OneBuild* build, DataType const (&t)[7], std::string const& layer)
{
    int32_t nbIn, nbOut;
    counts(in, nbIn, nbOut);
    auto inTypes = exactArray<DataType>(nbIn);
    auto outTypes = exactArray<DataType>(nbOut);
    for (int32_t i = 0; i < nbIn; ++i)
    {
        inTypes[i] = t[i % 7];
    }
    size_t const mark = gLogger.mark();
    int32_t const rc = build->getOutputDataTypes(outTypes.get(), nbOut, inTypes.get(), nbIn);
    bool const ok = nbIn == 5 && nbOut == 2 && isActivation(inTypes[0]) && inTypes[1] == inTypes[0];
    ++gStats.types[ok];
    FUZZ_CHECK(rc == (ok ? 0 : 1), "getOutputDataTypes rc " + std::to_string(rc));
    if (ok)
    {
        expectSilence(mark, "getOutputDataTypes");
        FUZZ_CHECK(outTypes[0] == inTypes[0] && outTypes[1] == inTypes[1], "getOutputDataTypes: output types");
    }
    else
    {
        expectOneError(mark, layer, "getOutputDataTypes");
    }
}

void fuzzOutputShapes(Input& in, IPluginV3OneBuild* build, Dims const (&d)[7], std::string const& layer)
{
    int32_t nbIn, nbOut;
    counts(in, nbIn, nbOut);
    qkrope_test::FakeExprBuilder eb;
    auto inputs = exactArray<DimsExprs>(nbIn);
    auto outputs = exactArray<DimsExprs>(nbOut);
    Dims seen[5];
    for (int32_t i = 0; i < nbIn; ++i)
    {
        Dims const& src = d[i % 7];
        inputs[i].nbDims = src.nbDims;
        seen[i % 5].nbDims = src.nbDims;
        for (int32_t j = 0; j < Dims::MAX_DIMS; ++j)
        {
            // A symbolic extent (unknown at network definition) or a constant one. TensorRT's constant
            // expressions are >= 0; a negative constant is read as unknown as well.
            bool const symbolic = src.d[j] == -1 || in.chance(40);
            inputs[i].d[j] = symbolic ? eb.impl.symbol() : eb.constant(src.d[j]);
            if (i < 5)
            {
                seen[i].d[j] = symbolic ? -1 : src.d[j];
            }
        }
    }
    size_t const mark = gLogger.mark();
    int32_t const rc = build->getOutputShapes(inputs.get(), nbIn, nullptr, 0, outputs.get(), nbOut, eb);
    bool ok = nbIn == 5 && nbOut == 2;
    for (int32_t i = 0; ok && i < 5; ++i)
    {
        ok = validRank(seen[i].nbDims);
    }
    ok = ok && shapesConsistent(seen);
    ++gStats.shapes[ok];
    FUZZ_CHECK(rc == (ok ? 0 : 1), "getOutputShapes rc " + std::to_string(rc) + ", model " + std::to_string(ok));
    if (ok)
    {
        expectSilence(mark, "getOutputShapes");
        for (int o = 0; o < 2; ++o)
        {
            DimsExprs const& src = inputs[o];
            FUZZ_CHECK(outputs[o].nbDims == src.nbDims, "getOutputShapes: output rank");
            for (int32_t j = 0; j < src.nbDims; ++j)
            {
                FUZZ_CHECK(outputs[o].d[j] == src.d[j], "getOutputShapes: output extent");
            }
        }
    }
    else
    {
        expectOneError(mark, layer, "getOutputShapes");
    }
}

// configurePlugin (build time, -1 wildcards) and onShapeChange (run time) take the same checks.
void fuzzConfigure(Input& in, IPluginV3OneBuild* build, IPluginV3OneRuntime* rt, Dims const (&d)[7],
    DataType const (&t)[7], std::string const& layer)
{
    int32_t nbIn, nbOut;
    counts(in, nbIn, nbOut);
    bool ok = nbIn == 5 && nbOut == 2;
    for (int i = 0; ok && i < 7; ++i)
    {
        ok = validRank(d[i].nbDims);
    }
    ok = ok && shapesConsistent(d);
    ++gStats.configure[ok];
    if (in.chance(128))
    {
        auto ins = exactArray<DynamicPluginTensorDesc>(nbIn);
        auto outs = exactArray<DynamicPluginTensorDesc>(nbOut);
        for (int32_t i = 0; i < nbIn + nbOut; ++i)
        {
            DynamicPluginTensorDesc& x = i < nbIn ? ins[i] : outs[i - nbIn];
            x.desc.dims = x.min = x.opt = x.max = d[i % 7];
            x.desc.type = t[i % 7];
            x.desc.format = TensorFormat::kLINEAR;
        }
        size_t const mark = gLogger.mark();
        int32_t const rc = build->configurePlugin(ins.get(), nbIn, outs.get(), nbOut);
        FUZZ_CHECK(rc == (ok ? 0 : 1), "configurePlugin rc " + std::to_string(rc) + ", model " + std::to_string(ok));
        ok ? expectSilence(mark, "configurePlugin") : expectOneError(mark, layer, "configurePlugin");
    }
    else
    {
        auto ins = exactArray<PluginTensorDesc>(nbIn);
        auto outs = exactArray<PluginTensorDesc>(nbOut);
        for (int32_t i = 0; i < nbIn + nbOut; ++i)
        {
            PluginTensorDesc& x = i < nbIn ? ins[i] : outs[i - nbIn];
            x.dims = d[i % 7];
            x.type = t[i % 7];
            x.format = TensorFormat::kLINEAR;
            x.scale = 1.0F;
        }
        size_t const mark = gLogger.mark();
        int32_t const rc = rt->onShapeChange(ins.get(), nbIn, outs.get(), nbOut);
        FUZZ_CHECK(rc == (ok ? 0 : 1), "onShapeChange rc " + std::to_string(rc) + ", model " + std::to_string(ok));
        ok ? expectSilence(mark, "onShapeChange") : expectOneError(mark, layer, "onShapeChange");
    }
}

void fuzzEnqueue(Input& in, IPluginV3OneRuntime* rt, Dims const (&d)[7], DataType const (&t)[7],
    qp::QKNormRoPEAttributes const& attrs, std::string const& layer)
{
    using qkrope::Status;
    alignas(16) static unsigned char dummy[7][16];
    void const* inputs[5] = {dummy[0], dummy[1], dummy[2], dummy[3], dummy[4]};
    void* outputs[2] = {dummy[5], dummy[6]};
    if (in.chance(16))
    {
        uint32_t const which = in.below(7);
        if (which < 5)
        {
            inputs[which] = nullptr;
        }
        else
        {
            outputs[which - 5] = nullptr;
        }
    }
    auto inDesc = exactArray<PluginTensorDesc>(5);
    auto outDesc = exactArray<PluginTensorDesc>(2);
    for (int i = 0; i < 7; ++i)
    {
        PluginTensorDesc& x = i < 5 ? inDesc[i] : outDesc[i - 5];
        x.dims = d[i];
        x.type = t[i];
        x.format = TensorFormat::kLINEAR;
        x.scale = 1.0F;
    }
    bool const nullArrays = in.chance(6);
    // the model
    int32_t want = 0;
    bool launches = false;       // the launcher is reached and its checkParams accepts
    bool reachesLauncher = false; // enqueue hands the parameters to the kernel's C ABI
    bool ownRefusal = false; // refused by enqueue's own shape/dtype checks (not by checkParams)
    qkrope::QKNormRoPEParams p{};
    if (nullArrays)
    {
        want = static_cast<int32_t>(Status::kNULL_POINTER);
    }
    else
    {
        bool ok = true;
        for (int i = 0; ok && i < 7; ++i)
        {
            ok = validRank(d[i].nbDims);
        }
        for (int i = 0; ok && i < 5; ++i)
        {
            for (int32_t j = 0; ok && j < d[i].nbDims; ++j)
            {
                ok = d[i].d[j] >= 0;
            }
        }
        ok = ok && shapesConsistent(d);
        for (int o = 0; ok && o < 2; ++o)
        {
            Dims const& od = d[5 + o];
            Dims const& id = d[o];
            ok = od.nbDims == id.nbDims;
            for (int32_t j = 0; ok && j < od.nbDims; ++j)
            {
                ok = od.d[j] == id.d[j];
            }
        }
        ok = ok && isActivation(t[0]) && t[4] == DataType::kFLOAT && t[1] == t[0] && t[2] == t[0] && t[3] == t[0]
            && t[5] == t[0] && t[6] == t[0];
        if (!ok)
        {
            want = static_cast<int32_t>(Status::kBAD_SHAPE);
            ownRefusal = true;
        }
        else
        {
            p.q = inputs[0];
            p.k = inputs[1];
            p.qWeight = inputs[2];
            p.kWeight = inputs[3];
            p.cache = static_cast<float const*>(inputs[4]);
            p.qOut = outputs[0];
            p.kOut = outputs[1];
            p.batch = d[0].d[0];
            p.seqLen = d[0].d[1];
            p.numHeads = d[0].d[2];
            p.headDim = d[0].d[3];
            p.rotaryDim = d[4].d[1];
            p.cacheRows = d[4].d[0];
            p.eps = attrs.epsilon;
            p.interleaved = attrs.interleaved != 0;
            p.rounding = attrs.rounding;
            p.dtype = t[0] == DataType::kHALF ? qkrope::DataType::kFLOAT16
                : t[0] == DataType::kBF16     ? qkrope::DataType::kBFLOAT16
                                              : qkrope::DataType::kFLOAT32;
            bool const empty = p.batch == 0 || p.seqLen == 0 || p.numHeads == 0;
            if (!empty)
            {
                // the C ABI checks the parameters (checkParams, first thing in the launcher)
                want = static_cast<int32_t>(qkrope::checkParams(p));
                launches = want == 0;
                reachesLauncher = true;
            }
        }
    }
    gLaunch = LaunchRecord{};
    size_t const mark = gLogger.mark();
    int32_t const rc = rt->enqueue(nullArrays ? nullptr : inDesc.get(), nullArrays ? nullptr : outDesc.get(),
        nullArrays && in.chance(128) ? nullptr : inputs, outputs, nullptr, nullptr);
    ++gStats.enqueue[rc == 0];
    gStats.launches += launches;
    FUZZ_CHECK(rc == want, "enqueue rc " + std::to_string(rc) + ", model " + std::to_string(want));
    FUZZ_CHECK(gLaunch.calls == (reachesLauncher ? 1 : 0),
        "enqueue called the launcher " + std::to_string(gLaunch.calls) + " times");
    FUZZ_CHECK(!reachesLauncher || static_cast<int32_t>(gLaunch.status) == want,
        "the launcher's own checkParams gave " + std::to_string(static_cast<int32_t>(gLaunch.status))
            + ", model " + std::to_string(want));
    if (reachesLauncher)
    {
        qkrope::QKNormRoPEParams const& g = gLaunch.params;
        FUZZ_CHECK(g.q == p.q && g.k == p.k && g.qWeight == p.qWeight && g.kWeight == p.kWeight && g.cache == p.cache
                && g.qOut == p.qOut && g.kOut == p.kOut && g.batch == p.batch && g.seqLen == p.seqLen
                && g.numHeads == p.numHeads && g.headDim == p.headDim && g.rotaryDim == p.rotaryDim
                && g.cacheRows == p.cacheRows && std::memcmp(&g.eps, &p.eps, sizeof(float)) == 0
                && g.interleaved == p.interleaved && g.rounding == p.rounding && g.dtype == p.dtype,
            "enqueue passed other parameters to the launcher than its descriptors and attributes give");
    }
    if (rc == 0)
    {
        expectSilence(mark, "enqueue");
    }
    else
    {
        expectOneError(mark, layer, "enqueue");
        if (ownRefusal)
        {
            FUZZ_CHECK(gLogger.lastSince(mark).find("nothing was executed") != std::string::npos,
                "enqueue's shape refusal does not say that nothing was executed: " + gLogger.lastSince(mark));
        }
    }
}

void fuzzPlugin(Input& in, IPluginV3* plugin, qp::QKNormRoPEAttributes const& attrs, std::string const& layer)
{
    IPluginV3OneCore* core = coreOf(plugin);
    IPluginV3OneBuild* build = buildOf(plugin);
    IPluginV3OneRuntime* rt = runtimeOf(plugin);
    FUZZ_CHECK(core != nullptr && build != nullptr && rt != nullptr, "a capability interface is null");
    FUZZ_CHECK(std::strcmp(core->getPluginName(), qp::kPLUGIN_NAME) == 0
            && std::strcmp(core->getPluginVersion(), qp::kPLUGIN_VERSION) == 0
            && std::strcmp(core->getPluginNamespace(), qp::kPLUGIN_NAMESPACE) == 0,
        "plugin identity");
    FUZZ_CHECK(build->getNbOutputs() == 2, "getNbOutputs");
    std::string const summary = qp::attributeSummary(attrs);
    FUZZ_CHECK(build->getTimingCacheID() != nullptr && summary == build->getTimingCacheID()
            && build->getMetadataString() != nullptr && summary == build->getMetadataString(),
        "timing-cache ID / metadata string differ from the attributes: " + summary);
    int const rounds = static_cast<int>(in.below(6)) + 1;
    for (int r = 0; r < rounds; ++r)
    {
        Problem const prob = makeProblem(in);
        Dims d[7];
        DataType t[7];
        uint8_t const which = in.u8() % 6;
        makeDims(in, prob, d, which == 2 || which == 3);
        makeTypes(in, t);
        switch (which)
        {
        case 0: gContext = "supportsFormatCombination"; fuzzFormats(in, build, d, t); break;
        case 1: gContext = "getOutputDataTypes"; fuzzOutputTypes(in, build, t, layer); break;
        case 2: gContext = "getOutputShapes"; fuzzOutputShapes(in, build, d, layer); break;
        case 3:
        case 4: gContext = "configurePlugin/onShapeChange"; fuzzConfigure(in, build, rt, d, t, layer); break;
        default: gContext = "enqueue"; fuzzEnqueue(in, rt, d, t, attrs, layer); break;
        }
    }
}

std::string layerName(Input& in, char const*& name)
{
    uint8_t const how = in.u8() % 8;
    if (how == 6)
    {
        name = nullptr;
        return {};
    }
    static std::string storage;
    storage = how == 7 ? std::string() : how == 5 ? std::string(300, 'L') : "fuzz_node_" + std::to_string(how);
    name = storage.c_str();
    return storage;
}

void fuzzOne(uint8_t const* data, size_t size)
{
    Input in(data, size);
    gLogger.messages.clear();
    gContext = "createPlugin";

    Collection c;
    makeCollection(in, c);
    char const* name = nullptr;
    std::string const layer = layerName(in, name);
    TensorRTPhase const phase = in.chance(100) ? TensorRTPhase::kRUNTIME : TensorRTPhase::kBUILD;
    Expected const want = model(c);

    size_t mark = gLogger.mark();
    PluginPtr p(gCreator->createPlugin(name, c.passNull ? nullptr : &c.fc, phase));
    if (!want.accept)
    {
        FUZZ_CHECK(p == nullptr, "createPlugin accepted fields the rules refuse (" + want.why + "), attributes "
                + (p ? attrsText(serialized(p.get(), "createPlugin")) : std::string()));
        expectOneError(mark, layer, "createPlugin");
        ++gStats.refused;
        return;
    }
    FUZZ_CHECK(p != nullptr, "createPlugin refused fields the rules accept (expected " + attrsText(want.attrs)
            + "): " + gLogger.lastSince(mark));
    expectSilence(mark, "createPlugin");
    ++gStats.created;
    gContext = "getFieldsToSerialize";
    qp::QKNormRoPEAttributes const got = serialized(p.get(), "createPlugin");
    FUZZ_CHECK(sameAttrs(got, want.attrs), "created " + attrsText(got) + ", expected " + attrsText(want.attrs));

    // serialise -> deserialise
    gContext = "serialisation round trip";
    PluginPtr r = recreate(p.get(), layer);
    FUZZ_CHECK(sameAttrs(serialized(r.get(), "recreated"), got), "the recreated plugin differs");
    FUZZ_CHECK(std::strcmp(buildOf(r.get())->getTimingCacheID(), buildOf(p.get())->getTimingCacheID()) == 0,
        "the recreated plugin has another timing-cache ID");

    // clone / attachToContext, sometimes outliving the source
    gContext = "clone/attachToContext";
    mark = gLogger.mark();
    PluginPtr cl(in.chance(128) ? p->clone() : runtimeOf(p.get())->attachToContext(nullptr));
    FUZZ_CHECK(cl != nullptr && cl.get() != p.get(), "clone/attachToContext returned null or the source");
    expectSilence(mark, "clone");
    PluginFieldCollection const* fp = runtimeOf(p.get())->getFieldsToSerialize();
    PluginFieldCollection const* fcl = runtimeOf(cl.get())->getFieldsToSerialize();
    FUZZ_CHECK(fp->nbFields > 0 && fcl->nbFields == fp->nbFields && fcl->fields[0].data != fp->fields[0].data,
        "the clone's serialised fields point into its source");
    if (in.chance(128))
    {
        p.reset();
        r.swap(p); // go on with the recreated plugin, the source is gone
    }
    FUZZ_CHECK(sameAttrs(serialized(cl.get(), "clone"), got), "the clone differs from its source");

    IPluginV3* target = in.chance(128) ? cl.get() : p.get();
    fuzzPlugin(in, target, got, layer);
    gContext = "teardown";
    PluginPtr again = recreate(target, layer); // still serialisable after all the calls
    FUZZ_CHECK(sameAttrs(serialized(again.get(), "final"), got), "attributes changed after the entry-point calls");
    ++gStats.roundTrips;
}

void setUp()
{
    static bool done = false;
    if (done)
    {
        return;
    }
    done = true;
    setLoggerFinder(&gFinder);
    int32_t n = 0;
    IPluginCreatorInterface* const* creators = getCreators(n);
    if (n != 1 || creators == nullptr || creators[0] == nullptr)
    {
        std::fprintf(stderr, "qkrope-fuzz: getCreators returned %d creators\n", n);
        std::abort();
    }
    gCreator = static_cast<IPluginCreatorV3One*>(creators[0]);
    PluginFieldCollection const* names = gCreator->getFieldNames();
    size_t nbAttributes = 0;
    for (qp::FieldSpec const& s : qp::kFIELDS)
    {
        nbAttributes += s.kind == qp::FieldKind::kATTRIBUTE;
    }
    if (names == nullptr || names->nbFields != static_cast<int32_t>(nbAttributes))
    {
        std::fprintf(stderr, "qkrope-fuzz: getFieldNames does not list the kFIELDS attributes\n");
        std::abort();
    }
}

} // namespace

extern "C" int LLVMFuzzerTestOneInput(uint8_t const* data, size_t size)
{
    setUp();
    fuzzOne(data, size);
    return 0;
}

#if !QKROPE_FUZZ_LIBFUZZER

namespace
{

std::vector<uint8_t> readFile(char const* path)
{
    std::ifstream f(path, std::ios::binary);
    return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}

std::vector<uint8_t> gCurrent;
uint64_t gSeed = 0;
uint64_t gIteration = 0;

void saveCurrent(int)
{
    char path[96];
    std::snprintf(path, sizeof(path), "qkrope-fuzz-crash-%" PRIu64 "-%" PRIu64, gSeed, gIteration);
    if (FILE* f = std::fopen(path, "wb"))
    {
        std::fwrite(gCurrent.data(), 1, gCurrent.size(), f);
        std::fclose(f);
    }
    std::fprintf(stderr, "qkrope-fuzz: failing input: seed %" PRIu64 " iteration %" PRIu64 " (%zu bytes) written to %s\n",
        gSeed, gIteration, gCurrent.size(), path);
}

} // namespace

#include <csignal>

extern "C" void __sanitizer_set_death_callback(void (*)(void)) __attribute__((weak));

int main(int argc, char** argv)
{
    uint64_t iterations = 0;
    size_t maxLen = 512;
    std::string seedsDir;
    std::vector<char const*> files;
    for (int i = 1; i < argc; ++i)
    {
        std::string const a = argv[i];
        auto value = [&]() -> char const* {
            if (i + 1 >= argc)
            {
                std::fprintf(stderr, "missing value after %s\n", a.c_str());
                std::exit(2);
            }
            return argv[++i];
        };
        if (a == "--iterations")
            iterations = std::strtoull(value(), nullptr, 10);
        else if (a == "--seed")
            gSeed = std::strtoull(value(), nullptr, 10);
        else if (a == "--max-len")
            maxLen = std::strtoull(value(), nullptr, 10);
        else if (a == "--write-seeds")
            seedsDir = value();
        else if (!a.empty() && a[0] == '-')
        {
            std::fprintf(stderr,
                "usage: %s --iterations N [--seed S] [--max-len L] [--write-seeds DIR] | FILE...\n", argv[0]);
            return 2;
        }
        else
            files.push_back(argv[i]);
    }
    setUp();
    std::signal(SIGABRT, saveCurrent);
    if (__sanitizer_set_death_callback)
    {
        __sanitizer_set_death_callback([] { saveCurrent(0); });
    }
    for (char const* f : files)
    {
        gCurrent = readFile(f);
        fuzzOne(gCurrent.data(), gCurrent.size());
        std::printf("qkrope-fuzz: replayed %s (%zu bytes)\n", f, gCurrent.size());
    }
    std::mt19937_64 rng(gSeed);
    for (gIteration = 0; gIteration < iterations; ++gIteration)
    {
        size_t const len = maxLen ? static_cast<size_t>(rng() % (maxLen + 1)) : 0;
        gCurrent.resize(len);
        for (auto& b : gCurrent)
        {
            b = static_cast<uint8_t>(rng());
        }
        if (!seedsDir.empty())
        {
            std::ofstream(seedsDir + "/seed-" + std::to_string(gIteration), std::ios::binary)
                .write(reinterpret_cast<char const*>(gCurrent.data()), static_cast<std::streamsize>(gCurrent.size()));
            continue;
        }
        fuzzOne(gCurrent.data(), gCurrent.size());
    }
    if (iterations != 0 && seedsDir.empty())
    {
        std::printf("qkrope-fuzz: %" PRIu64 " iterations, seed %" PRIu64 ", max length %zu: no invariant violated\n",
            iterations, gSeed, maxLen);
        Stats const& t = gStats;
        std::printf("STATS created=%" PRIu64 " refused=%" PRIu64 " round_trips=%" PRIu64 " formats=%" PRIu64
                    " types_ok=%" PRIu64 " types_refused=%" PRIu64 " shapes_ok=%" PRIu64 " shapes_refused=%" PRIu64
                    " configure_ok=%" PRIu64 " configure_refused=%" PRIu64 " enqueue_ok=%" PRIu64
                    " enqueue_refused=%" PRIu64 " launches=%" PRIu64 "\n",
            t.created, t.refused, t.roundTrips, t.formats, t.types[1], t.types[0], t.shapes[1], t.shapes[0],
            t.configure[1], t.configure[0], t.enqueue[1], t.enqueue[0], t.launches);
    }
    return 0;
}

#endif
