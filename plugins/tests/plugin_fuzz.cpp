// qkrope: fuzz target for the QKNormRoPE plugin creator, its field parsing and deserialisation, and
// the IPluginV3 entry points that take tensor descriptors. One binary, two drivers:
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
//
// The target's pieces (plugin_fuzz.h declares what they share): this file (the launch stub, failure
// reporting, plugin views and the serialisation round trip, one fuzz iteration, both drivers);
// plugin_fuzz_fields.cpp (the field-collection decoder); plugin_fuzz_field_model.cpp (the model of
// the parsing rules); plugin_fuzz_tensors.cpp (tensor descriptors and the shape/dtype model);
// plugin_fuzz_methods.cpp (the checks of each entry point).
#include "plugin_fuzz.h"

// The version-compatible entry points (qknorm_rope_plugin_entry.cpp, QKROPE_VC_PLUGIN=1), compiled in.
extern "C" IPluginCreatorInterface* const* getCreators(int32_t& nbCreators);
extern "C" void setLoggerFinder(ILoggerFinder* finder);

// ---- the launch stub ------------------------------------------------------------------------------

namespace qkrope_fuzz
{
LaunchRecord gLaunch;
} // namespace qkrope_fuzz

namespace qkrope
{
// Stands in for the CUDA launcher (qknorm_rope.cu): the same contract (checkParams first, its status
// returned when it fails), no kernel. Records what it was given.
Status launchQKNormRoPE(QKNormRoPEParams const& p, cudaStream_t /*stream*/) noexcept
{
    ++qkrope_fuzz::gLaunch.calls;
    qkrope_fuzz::gLaunch.params = p;
    qkrope_fuzz::gLaunch.status = checkParams(p);
    return qkrope_fuzz::gLaunch.status;
}
} // namespace qkrope

namespace qkrope_fuzz
{

// ---- failure reporting ----------------------------------------------------------------------------

std::string gContext; // what the current iteration is doing, for the report

[[noreturn]] void violated(std::string const& what)
{
    std::fprintf(stderr, "qkrope-fuzz: INVARIANT VIOLATED during %s: %s\n", gContext.c_str(), what.c_str());
    std::fflush(stderr);
    std::abort();
}

// What the inputs reached, printed by the seeded loop ("STATS ...") and checked by the test.
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

// ---- plugin views ---------------------------------------------------------------------------------

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

namespace
{

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

} // namespace qkrope_fuzz

extern "C" int LLVMFuzzerTestOneInput(uint8_t const* data, size_t size)
{
    qkrope_fuzz::setUp();
    qkrope_fuzz::fuzzOne(data, size);
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
    qkrope_fuzz::setUp();
    std::signal(SIGABRT, saveCurrent);
    if (__sanitizer_set_death_callback)
    {
        __sanitizer_set_death_callback([] { saveCurrent(0); });
    }
    for (char const* f : files)
    {
        gCurrent = readFile(f);
        qkrope_fuzz::fuzzOne(gCurrent.data(), gCurrent.size());
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
        qkrope_fuzz::fuzzOne(gCurrent.data(), gCurrent.size());
    }
    if (iterations != 0 && seedsDir.empty())
    {
        std::printf("qkrope-fuzz: %" PRIu64 " iterations, seed %" PRIu64 ", max length %zu: no invariant violated\n",
            iterations, gSeed, maxLen);
        qkrope_fuzz::Stats const& t = qkrope_fuzz::gStats;
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
