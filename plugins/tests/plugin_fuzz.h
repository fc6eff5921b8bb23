// qkrope: the internal header of the plugin's fuzz target (plugin_fuzz.cpp and the
// plugin_fuzz_*.cpp pieces, built by fuzz/CMakeLists.txt only): the input decoder, the shared
// records and the functions one piece calls in another. Not for any other target (it brings
// nvinfer1 into the global namespace, as each piece's code is written against it).
#pragma once

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

namespace qkrope_fuzz
{

// ---- the launch stub (plugin_fuzz.cpp) ------------------------------------------------------------

struct LaunchRecord
{
    int calls{0};
    qkrope::QKNormRoPEParams params{};
    qkrope::Status status{qkrope::Status::kSUCCESS};
};
extern LaunchRecord gLaunch;

// ---- failure reporting (plugin_fuzz.cpp) ----------------------------------------------------------

extern std::string gContext; // what the current iteration is doing, for the report

[[noreturn]] void violated(std::string const& what);

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
extern Stats gStats;

extern qkrope_test::RecordingLogger gLogger;

// Every message since `mark` is one error that names the plugin (and `layer` unless empty).
void expectOneError(size_t mark, std::string const& layer, char const* where);
void expectSilence(size_t mark, char const* where);

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

// ---- field collections (plugin_fuzz_fields.cpp) ---------------------------------------------------

size_t elementSize(PluginFieldType t);

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

std::unique_ptr<char[]> heapString(std::string const& s);
qp::FieldSpec const* specNamed(char const* name);
void makeCollection(Input& in, Collection& c);

// ---- the reference model of the parsing rules (plugin_fuzz_field_model.cpp) -----------------------

struct Expected
{
    bool accept{false};
    qp::QKNormRoPEAttributes attrs{};
    std::string why;
};

Expected model(Collection const& c);
bool sameAttrs(qp::QKNormRoPEAttributes const& a, qp::QKNormRoPEAttributes const& b);
std::string attrsText(qp::QKNormRoPEAttributes const& a);

// ---- plugin views (plugin_fuzz.cpp) ---------------------------------------------------------------

using PluginPtr = std::unique_ptr<IPluginV3>;

IPluginV3OneCore* coreOf(IPluginV3* p);
IPluginV3OneBuild* buildOf(IPluginV3* p);
IPluginV3OneRuntime* runtimeOf(IPluginV3* p);

// ---- tensor descriptors and the shape/dtype model (plugin_fuzz_tensors.cpp) -----------------------

struct Problem
{
    int64_t batch, seq, heads, headDim, rows, rot;
};

Problem makeProblem(Input& in);
// q, k, q_weight, k_weight, cos_sin_cache, q_out, k_out: a valid problem, then perturbed. The weights
// are [head_dim] with norm_scope 0, [heads * head_dim] with 1.
void makeDims(Input& in, Problem const& p, Dims (&d)[7], bool allowWildcards, int32_t normScope);
void makeTypes(Input& in, DataType (&t)[7]);
TensorFormat pickFormat(Input& in);
bool validRank(int32_t r);
// Build-time and run-time shape consistency of the five inputs (extents < 0: unknown) for the plugin's
// norm_scope.
bool shapesConsistent(Dims const* d, int32_t normScope);
bool isActivation(DataType t);

// ---- the per-plugin checks (plugin_fuzz_methods.cpp) ----------------------------------------------

void fuzzPlugin(Input& in, IPluginV3* plugin, qp::QKNormRoPEAttributes const& attrs, std::string const& layer);

} // namespace qkrope_fuzz
