// qkrope: host test checks of the plugin creator and its fields: identity and field list
// (getFieldNames), createPlugin from the ONNX parser's field forms, defaults for missing fields,
// wide types, and every bad field refused with one logged error naming it, in both phases.
#include "plugin_host_test.h"

#include <cstdio>
#include <limits>

namespace qkrope_host_test
{

// ---- creator: identity and field list --------------------------------------------------------

void testCreator(IPluginCreatorV3One* creator, Args const& args)
{
    check(std::string(creator->getPluginName()) == args.name, "creator.name", creator->getPluginName());
    check(std::string(creator->getPluginVersion()) == args.version, "creator.version", creator->getPluginVersion());
    check(std::string(creator->getPluginNamespace()) == args.ns, "creator.namespace", creator->getPluginNamespace());
    check(std::string(creator->getInterfaceInfo().kind) == "PLUGIN CREATOR_V3ONE", "creator.interface_kind",
        creator->getInterfaceInfo().kind);

    PluginFieldCollection const* names = creator->getFieldNames();
    check(names != nullptr, "creator.fields.present");
    if (names == nullptr)
    {
        return;
    }
    std::string got;
    std::vector<std::pair<std::string, std::string>> list;
    for (int32_t i = 0; i < names->nbFields; ++i)
    {
        PluginField const& f = names->fields[i];
        list.emplace_back(f.name, fieldTypeName(f.type));
        std::printf("FIELD %s %s %d\n", f.name, fieldTypeName(f.type), f.length);
        got += std::string(f.name) + ":" + fieldTypeName(f.type) + " ";
    }
    if (!args.fields.empty())
    {
        check(list == args.fields, "creator.fields.match_contract", "got " + got);
    }
}

// ---- create: the parser's field forms, string fields, defaults, wide types -------------------

void testCreate(IPluginCreatorV3One* c, Args const& args, RecordingLogger& logger)
{
    float const dEps = static_cast<float>(args.defaultOf("epsilon", 1e-6));
    int32_t const dIl = static_cast<int32_t>(args.defaultOf("interleaved", 1));
    int32_t const dR = static_cast<int32_t>(args.defaultOf("rounding", 0));

    // Exactly what the ONNX parser forwards. (It narrows INT (int64) to int32; our values are 0/1,
    // so narrowing is lossless.)
    Fields parsed = parserFields(1e-5F, 0, 1);
    PluginPtr p = create(c, &parsed);
    check(p != nullptr, "create.parser_fields", logger.lastSince(0));
    if (p)
    {
        check(serializedAttrs(p.get()).equals(1e-5F, 0, 1), "create.parser_fields.values", describe(p.get(), logger));
    }
    // Strings as the parser copies them (NUL counted), and without the NUL counted.
    for (bool countNul : {true, false})
    {
        Fields f = parserFields(1e-6F, 1, 0);
        f.str("plugin_version", args.version, countNul).str("plugin_namespace", args.ns, countNul);
        check(create(c, &f) != nullptr,
            std::string("create.string_fields.") + (countNul ? "nul_counted" : "nul_not_counted"), logger.lastSince(0));
    }
    // Missing fields -> defaults.
    struct Case
    {
        char const* name;
        Fields fields;
        bool nullCollection;
        float eps;
        int32_t interleaved;
        int32_t rounding;
    };
    Fields onlyEps;
    onlyEps.add("epsilon", 1e-3F, PluginFieldType::kFLOAT32);
    Fields onlyRounding;
    onlyRounding.add("rounding", int32_t{1}, PluginFieldType::kINT32);
    // FLUX's eager order (rounding = 2), the largest mode, as the parser forwards it.
    Fields flux = parserFields(1e-6F, 1, 2);
    // Defensive widths: kINT64 ints, kFLOAT64 epsilon (Python/numpy callers).
    Fields wide;
    wide.add("epsilon", 1e-5, PluginFieldType::kFLOAT64);
    wide.add("interleaved", int64_t{0}, PluginFieldType::kINT64);
    wide.add("rounding", int64_t{1}, PluginFieldType::kINT64);
    std::vector<Case> cases = {
        {"create.defaults.null_collection", Fields{}, true, dEps, dIl, dR},
        {"create.defaults.empty_collection", Fields{}, false, dEps, dIl, dR},
        {"create.defaults.only_epsilon", onlyEps, false, 1e-3F, dIl, dR},
        {"create.defaults.only_rounding", onlyRounding, false, dEps, dIl, 1},
        {"create.rounding_flux", flux, false, 1e-6F, 1, 2},
        {"create.wide_types", wide, false, 1e-5F, 0, 1},
    };
    for (Case& cs : cases)
    {
        PluginPtr q = create(c, cs.nullCollection ? nullptr : &cs.fields);
        check(q != nullptr && serializedAttrs(q.get()).equals(cs.eps, cs.interleaved, cs.rounding), cs.name,
            describe(q.get(), logger));
    }
}

namespace
{

// ---- bad_field: every bad field -> nullptr + one logged error naming the field ---------------

struct BadField
{
    char const* name;
    char const* mentions;
    Fields f;
};

std::vector<BadField> badFieldCases()
{
    auto one = [](char const* field, auto value, PluginFieldType type, int32_t length = 1) {
        Fields f;
        f.add(field, value, type, length);
        return f;
    };
    auto str = [](char const* field, char const* value) {
        Fields f;
        f.str(field, value);
        return f;
    };
    Fields nullData;
    nullData.raw("epsilon", std::vector<char>(4), PluginFieldType::kFLOAT32, 1, /*nullData=*/true);
    // A kCHAR whose length is negative: refused, not read as a huge size_t (the string would be
    // scanned past its end up to some NUL).
    Fields negativeLength;
    negativeLength.raw("plugin_version", {'1', '\0'}, PluginFieldType::kCHAR, -1);
    Fields duplicate;
    duplicate.add("rounding", int32_t{0}, PluginFieldType::kINT32).add("rounding", int32_t{1}, PluginFieldType::kINT32);
    using T = PluginFieldType;
    return {
        {"epsilon_zero", "epsilon", one("epsilon", 0.0F, T::kFLOAT32)},
        {"epsilon_negative", "epsilon", one("epsilon", -1e-6F, T::kFLOAT32)},
        {"epsilon_nan", "epsilon", one("epsilon", std::nanf(""), T::kFLOAT32)},
        {"epsilon_inf", "epsilon", one("epsilon", std::numeric_limits<float>::infinity(), T::kFLOAT32)},
        {"epsilon_f64_underflow", "epsilon", one("epsilon", 1e-300, T::kFLOAT64)}, // 0 in float32
        {"interleaved_2", "interleaved", one("interleaved", int32_t{2}, T::kINT32)},
        {"interleaved_negative", "interleaved", one("interleaved", int32_t{-1}, T::kINT32)},
        {"rounding_3", "rounding", one("rounding", int32_t{3}, T::kINT32)},
        {"norm_scope_2", "norm_scope", one("norm_scope", int32_t{2}, T::kINT32)},
        {"rounding_negative", "rounding", one("rounding", int32_t{-1}, T::kINT32)},
        {"rounding_int64_out_of_range", "rounding", one("rounding", int64_t{1} << 32 | 1, T::kINT64)},
        {"epsilon_wrong_type_int32", "epsilon", one("epsilon", int32_t{1}, T::kINT32)},
        {"epsilon_wrong_type_char", "epsilon", str("epsilon", "1e-6")},
        {"interleaved_wrong_type_float", "interleaved", one("interleaved", 1.0F, T::kFLOAT32)},
        {"rounding_wrong_type_char", "rounding", str("rounding", "0")},
        {"epsilon_wrong_type_fp16", "epsilon", one("epsilon", 1e-6F, T::kFLOAT16)},
        {"interleaved_length_2", "interleaved", one("interleaved", int32_t{1}, T::kINT32, 2)},
        {"rounding_length_0", "rounding", one("rounding", int32_t{0}, T::kINT32, 0)},
        {"epsilon_null_data", "epsilon", nullData},
        {"unknown_field", "theta", one("theta", 10000.0F, T::kFLOAT32)},
        {"duplicate_field", "rounding", duplicate},
        {"plugin_version_mismatch", "plugin_version", str("plugin_version", "2")},
        {"plugin_namespace_mismatch", "plugin_namespace", str("plugin_namespace", "other")},
        {"plugin_version_wrong_type", "plugin_version", one("plugin_version", int32_t{1}, T::kINT32)},
        {"plugin_version_negative_length", "plugin_version", negativeLength},
    };
}
} // namespace

void testBadFields(IPluginCreatorV3One* c, RecordingLogger& logger)
{
    std::vector<BadField> bad = badFieldCases();
    for (TensorRTPhase phase : {TensorRTPhase::kBUILD, TensorRTPhase::kRUNTIME})
    {
        for (auto& b : bad)
        {
            size_t const mark = logger.mark();
            PluginPtr p = create(c, &b.f, phase, "bad_node");
            std::string const last = logger.lastSince(mark);
            bool const logged = logger.errorsSince(mark) == 1 && last.find(b.mentions) != std::string::npos
                && last.find("bad_node") != std::string::npos;
            std::string const n
                = std::string("bad_field.") + b.name + (phase == TensorRTPhase::kBUILD ? ".build" : ".runtime");
            check(p == nullptr && logged, n, std::string(p ? "a plugin was created" : "nullptr") + "; logged: " + last);
            if (phase == TensorRTPhase::kBUILD && p == nullptr)
            {
                std::printf("MESSAGE %s %s\n", b.name, last.c_str());
            }
        }
    }
    // A malformed collection (nbFields > 0, fields null).
    PluginFieldCollection fc{};
    fc.nbFields = 2;
    fc.fields = nullptr;
    size_t const mark = logger.mark();
    PluginPtr p(c->createPlugin("bad_node", &fc, TensorRTPhase::kBUILD));
    check(p == nullptr && logger.errorsSince(mark) == 1, "bad_field.malformed_collection", logger.lastSince(mark));
}

} // namespace qkrope_host_test
