// qkrope: host test checks of the plugin's core and build-time capability (IPluginV3OneCore,
// IPluginV3OneBuild): names and timing-cache ID, getOutputShapes through a test IExprBuilder, the
// supportsFormatCombination matrix, getOutputDataTypes, and configurePlugin refusing malformed
// shapes.
#include "plugin_host_test.h"

#include <cstring>

namespace qkrope_host_test
{

// ---- plugin: capabilities, names, outputs, timing-cache ID -----------------------------------

void testPluginCore(IPluginV3OneCore* core, IPluginV3OneBuild* build, IPluginV3OneRuntime* rt)
{
    check(std::string(core->getInterfaceInfo().kind) == "PLUGIN_V3ONE_CORE"
            && std::string(build->getInterfaceInfo().kind) == "PLUGIN_V3ONE_BUILD"
            && std::string(rt->getInterfaceInfo().kind) == "PLUGIN_V3ONE_RUNTIME",
        "plugin.capability_kinds");
    check(std::string(core->getPluginName()) == "QKNormRoPE" && std::string(core->getPluginVersion()) == "1"
            && std::string(core->getPluginNamespace()) == "qkrope",
        "plugin.core_names");
    check(build->getNbOutputs() == 2, "plugin.nb_outputs");
    char const* id = build->getTimingCacheID();
    check(id != nullptr && std::strstr(id, "rounding=0") != nullptr, "plugin.timing_cache_id", id ? id : "null");
}

// ---- shapes: getOutputShapes through a test IExprBuilder -------------------------------------

namespace
{

DimsExprs dimsExprs(std::vector<IDimensionExpr const*> const& v)
{
    DimsExprs d{};
    d.nbDims = static_cast<int32_t>(v.size());
    for (size_t i = 0; i < v.size(); ++i)
    {
        d.d[i] = v[i];
    }
    return d;
}

} // namespace

void testOutputShapes(IPluginV3OneBuild* build, RecordingLogger& logger)
{
    FakeExprBuilder eb;
    auto cst = [&](int64_t v) { return eb.constant(v); };
    IDimensionExpr const* B = eb.impl.symbol();
    IDimensionExpr const* S = eb.impl.symbol();
    IDimensionExpr const* R = eb.impl.symbol();
    IDimensionExpr const* H = cst(24);
    IDimensionExpr const* D = cst(128);
    DimsExprs out[2]{};
    auto run = [&](std::vector<DimsExprs> const& in) {
        size_t const mark = logger.mark();
        int32_t const rc = build->getOutputShapes(in.data(), static_cast<int32_t>(in.size()), nullptr, 0, out, 2, eb);
        return std::make_pair(rc, logger.lastSince(mark));
    };

    std::vector<DimsExprs> in = {dimsExprs({B, S, H, D}), dimsExprs({B, S, H, D}), dimsExprs({D}), dimsExprs({D}),
        dimsExprs({R, D})};
    auto r = run(in);
    bool same = r.first == 0;
    for (int32_t o = 0; same && o < 2; ++o)
    {
        same = out[o].nbDims == 4;
        for (int32_t j = 0; same && j < 4; ++j)
        {
            same = out[o].d[j] == in[o].d[j];
        }
    }
    check(same, "shapes.dynamic_equals_inputs", r.second);

    std::vector<DimsExprs> st = {dimsExprs({cst(1), cst(4608), H, D}), dimsExprs({cst(1), cst(4608), H, D}),
        dimsExprs({D}), dimsExprs({D}), dimsExprs({cst(4608), D})};
    r = run(st);
    check(r.first == 0 && out[0].d[1]->isConstant() && out[0].d[1]->getConstantValue() == 4608
            && out[1].d[3]->getConstantValue() == 128,
        "shapes.static_equals_inputs", r.second);

    struct BadShape
    {
        char const* name;
        std::vector<DimsExprs> in;
    };
    std::vector<BadShape> const badShapes = {
        {"weight_length", {in[0], in[1], dimsExprs({cst(64)}), in[3], in[4]}},
        {"rotary_odd", {in[0], in[1], in[2], in[3], dimsExprs({R, cst(127)})}},
        {"rotary_gt_head_dim", {in[0], in[1], in[2], in[3], dimsExprs({R, cst(256)})}},
        {"cache_overflow", {st[0], st[1], st[2], st[3], dimsExprs({cst(4000), D})}},
        {"q_rank", {dimsExprs({B, S, D}), in[1], in[2], in[3], in[4]}},
        {"cache_rank", {in[0], in[1], in[2], in[3], dimsExprs({D})}},
        {"qk_mismatch", {in[0], dimsExprs({B, S, cst(12), D}), in[2], in[3], in[4]}},
        {"head_dim_odd", {dimsExprs({B, S, H, cst(127)}), dimsExprs({B, S, H, cst(127)}), dimsExprs({cst(127)}),
                             dimsExprs({cst(127)}), dimsExprs({R, cst(126)})}},
    };
    for (auto const& b : badShapes)
    {
        auto rb = run(b.in);
        check(rb.first != 0 && rb.second != "<no message>", std::string("shapes.bad.") + b.name, rb.second);
    }
    std::vector<DimsExprs> rank9 = in;
    rank9[0].nbDims = 9;
    auto r9 = run(rank9);
    check(r9.first != 0 && missingFrom(r9.second, {"invalid rank", "nbDims = 9", "(q)"}).empty(),
        "shapes.bad.nb_dims_9", r9.second);
    std::vector<DimsExprs> four(in.begin(), in.begin() + 4);
    check(build->getOutputShapes(four.data(), 4, nullptr, 0, out, 2, eb) != 0, "shapes.bad.nb_inputs");
}

// ---- formats: the supportsFormatCombination matrix -------------------------------------------

void testFormats(IPluginV3OneBuild* build)
{
    std::vector<DataType> const all = {DataType::kFLOAT, DataType::kHALF, DataType::kBF16, DataType::kINT8,
        DataType::kINT32, DataType::kINT64, DataType::kBOOL};
    Shapes const s = goodShapes();
    bool ok = true;
    std::string detail;
    int32_t combos = 0;
    auto expectFalse = [&](int32_t pos, std::vector<DynamicPluginTensorDesc> const& d, std::string const& what) {
        if (build->supportsFormatCombination(pos, d.data(), 5, 2))
        {
            ok = false;
            detail += what + "; ";
        }
    };
    for (DataType qt : all)
    {
        bool const actSupported = qt == DataType::kFLOAT || qt == DataType::kHALF || qt == DataType::kBF16;
        bool const r0 = build->supportsFormatCombination(0, dynDescs(s, qt).data(), 5, 2);
        if (r0 != actSupported)
        {
            ok = false;
            detail += std::string("q ") + typeName(qt) + " -> " + (r0 ? "true" : "false") + "; ";
        }
        if (!actSupported)
        {
            continue;
        }
        for (int32_t pos = 1; pos < 7; ++pos)
        {
            for (DataType t : all)
            {
                auto dd = dynDescs(s, qt);
                dd[pos].desc.type = t;
                // the cache is float32; q_weight q's type or float32 (k_weight follows q_weight,
                // here q's type); the rest q's type
                bool const expect = pos == 4 ? t == DataType::kFLOAT
                    : pos == 2                ? t == qt || t == DataType::kFLOAT
                                              : t == qt;
                bool const got = build->supportsFormatCombination(pos, dd.data(), 5, 2);
                combos += got;
                if (got != expect)
                {
                    ok = false;
                    detail += std::string("q ") + typeName(qt) + " pos " + std::to_string(pos) + " " + typeName(t)
                        + " -> " + (got ? "true" : "false") + "; ";
                }
            }
            auto dd = dynDescs(s, qt);
            dd[pos].desc.format = TensorFormat::kHWC8;
            expectFalse(pos, dd, "non-linear format accepted at pos " + std::to_string(pos));
        }
        auto dd = dynDescs(s, qt);
        dd[0].desc.format = TensorFormat::kCHW32;
        expectFalse(0, dd, "non-linear q accepted");
        // fp32 weights: k_weight follows q_weight, not q
        auto fw = dynDescs(s, qt);
        fw[2].desc.type = DataType::kFLOAT;
        fw[3].desc.type = DataType::kFLOAT;
        if (!build->supportsFormatCombination(2, fw.data(), 5, 2) || !build->supportsFormatCombination(3, fw.data(), 5, 2))
        {
            ok = false;
            detail += std::string("q ") + typeName(qt) + " with float32 weights refused; ";
        }
        if (qt != DataType::kFLOAT)
        {
            fw[3].desc.type = qt;
            expectFalse(3, fw, std::string("k_weight ") + typeName(qt) + " accepted beside a float32 q_weight");
        }
    }
    check(ok, "formats.matrix", detail);
    // per q type: 6 positions of one type each, plus float32 q_weight under fp16 and bf16
    check(combos == 3 * 6 + 2, "formats.count", std::to_string(combos) + " accepted (pos, type) pairs, expected 20");
    auto d = dynDescs(s, DataType::kHALF);
    check(!build->supportsFormatCombination(7, d.data(), 5, 2) && !build->supportsFormatCombination(-1, d.data(), 5, 2)
            && !build->supportsFormatCombination(0, d.data(), 4, 2),
        "formats.out_of_range");
}

// ---- dtypes: getOutputDataTypes ---------------------------------------------------------------

void testOutputDataTypes(IPluginV3OneBuild* build, RecordingLogger& logger)
{
    bool ok = true;
    std::string detail;
    for (DataType t : {DataType::kFLOAT, DataType::kHALF, DataType::kBF16})
    {
        DataType in[5] = {t, t, t, t, DataType::kFLOAT};
        DataType out[2] = {DataType::kINT8, DataType::kINT8};
        int32_t rc = build->getOutputDataTypes(out, 2, in, 5);
        if (rc != 0 || out[0] != t || out[1] != t)
        {
            ok = false;
            detail += std::string(typeName(t)) + " ";
        }
    }
    check(ok, "dtypes.same_as_inputs", detail);
    DataType mixed[5] = {DataType::kFLOAT, DataType::kHALF, DataType::kFLOAT, DataType::kFLOAT, DataType::kFLOAT};
    DataType out[2];
    size_t mark = logger.mark();
    check(build->getOutputDataTypes(out, 2, mixed, 5) != 0 && logger.errorsSince(mark) == 1, "dtypes.bad.q_k_mismatch",
        logger.lastSince(mark));
    DataType ints[5] = {DataType::kINT32, DataType::kINT32, DataType::kINT32, DataType::kINT32, DataType::kFLOAT};
    mark = logger.mark();
    check(build->getOutputDataTypes(out, 2, ints, 5) != 0 && logger.errorsSince(mark) == 1, "dtypes.bad.int32",
        logger.lastSince(mark));
    check(build->getOutputDataTypes(out, 1, ints, 5) != 0, "dtypes.bad.nb_outputs");
}

// ---- configure: configurePlugin (build time, dynamic and static shapes) ----------------------

void testConfigure(IPluginV3OneBuild* build, RecordingLogger& logger)
{
    Shapes dyn{{-1, -1, 24, 128}, {-1, -1, 24, 128}, {128}, {128}, {-1, 128}};
    auto in = dynDescs(dyn, DataType::kBF16);
    check(build->configurePlugin(in.data(), 5, in.data() + 5, 2) == 0, "configure.dynamic_ok", logger.lastSince(0));
    Shapes bad{{1, 4608, 24, 128}, {1, 4608, 24, 128}, {128}, {128}, {4096, 128}};
    auto inBad = dynDescs(bad, DataType::kBF16);
    size_t const mark = logger.mark();
    check(build->configurePlugin(inBad.data(), 5, inBad.data() + 5, 2) != 0
            && logger.lastSince(mark).find("overflow") != std::string::npos,
        "configure.static_cache_overflow", logger.lastSince(mark));
    for (BadRank const& b : badRankCases())
    {
        auto d = dynDescs(goodShapes(), DataType::kHALF);
        setRank(d[b.tensor].desc.dims, b.nbDims);
        size_t const at = logger.mark();
        int32_t const rc = build->configurePlugin(d.data(), 5, d.data() + 5, 2);
        checkRefusal(std::string("configure.bad.") + b.name, rc, 1, logger, at, b.needles);
    }
}

} // namespace qkrope_host_test
