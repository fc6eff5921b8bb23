// qkrope fuzz target: the checks of each IPluginV3 entry point that takes tensor descriptors
// (supportsFormatCombination, getOutputDataTypes, getOutputShapes, configurePlugin/onShapeChange,
// enqueue) against the models, and fuzzPlugin, which drives them. Overview: plugin_fuzz.cpp.
#include "plugin_fuzz.h"

namespace qkrope_fuzz
{

// ---- the per-plugin checks ------------------------------------------------------------------------

namespace
{

// The norm_scope of the plugin under test (fuzzPlugin sets it): the weights' expected width.
int32_t gNormScope = 0;

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
        want = pos == 0 ? isActivation(ty)
            : pos == 4  ? ty == DataType::kFLOAT
            : pos == 2  ? ty == inOut[0].desc.type || ty == DataType::kFLOAT // fp32 weights under any q
            : pos == 3  ? ty == inOut[2].desc.type
                        : ty == inOut[0].desc.type;
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
    ok = ok && shapesConsistent(seen, gNormScope);
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
    ok = ok && shapesConsistent(d, gNormScope);
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
        ok = ok && shapesConsistent(d, gNormScope);
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
        ok = ok && isActivation(t[0]) && t[4] == DataType::kFLOAT && t[1] == t[0]
            && (t[2] == t[0] || t[2] == DataType::kFLOAT) && t[3] == t[2] && t[5] == t[0] && t[6] == t[0];
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
            p.normScope = attrs.normScope;
            p.dtype = t[0] == DataType::kHALF ? qkrope::DataType::kFLOAT16
                : t[0] == DataType::kBF16     ? qkrope::DataType::kBFLOAT16
                                              : qkrope::DataType::kFLOAT32;
            p.weightsFp32 = t[2] == DataType::kFLOAT;
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
                && g.interleaved == p.interleaved && g.rounding == p.rounding && g.normScope == p.normScope
                && g.dtype == p.dtype && g.weightsFp32 == p.weightsFp32,
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

} // namespace

void fuzzPlugin(Input& in, IPluginV3* plugin, qp::QKNormRoPEAttributes const& attrs, std::string const& layer)
{
    IPluginV3OneCore* core = coreOf(plugin);
    IPluginV3OneBuild* build = buildOf(plugin);
    IPluginV3OneRuntime* rt = runtimeOf(plugin);
    gNormScope = attrs.normScope;
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
        makeDims(in, prob, d, which == 2 || which == 3, gNormScope);
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

} // namespace qkrope_fuzz
