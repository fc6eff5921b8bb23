// qkrope: host test checks of the plugin's run-time capability (IPluginV3OneRuntime):
// onShapeChange and enqueue refusing malformed shapes without touching memory, the
// getFieldsToSerialize -> createPlugin(kRUNTIME) round trip, clone and attachToContext.
#include "plugin_host_test.h"

#include <cstdio>

namespace qkrope_host_test
{

// ---- shape_change: onShapeChange (run time) ---------------------------------------------------

void testShapeChange(IPluginV3OneRuntime* rt, RecordingLogger& logger)
{
    auto ok = descs(goodShapes(), DataType::kHALF);
    check(rt->onShapeChange(ok.data(), 5, ok.data() + 5, 2) == 0, "shape_change.ok", logger.lastSince(0));
    Shapes s = goodShapes();
    s.cache = {15, 128};
    auto overflow = descs(s, DataType::kHALF);
    size_t const mark = logger.mark();
    check(rt->onShapeChange(overflow.data(), 5, overflow.data() + 5, 2) != 0
            && logger.lastSince(mark).find("required rows (seq_len) = 16, cache rows = 15, overflow = 1")
                != std::string::npos,
        "shape_change.cache_overflow", logger.lastSince(mark));
    for (BadRank const& b : badRankCases())
    {
        auto d = descs(goodShapes(), DataType::kHALF);
        setRank(d[b.tensor].dims, b.nbDims);
        size_t const at = logger.mark();
        int32_t const rc = rt->onShapeChange(d.data(), 5, d.data() + 5, 2);
        checkRefusal(std::string("shape_change.bad.") + b.name, rc, 1, logger, at, b.needles);
    }
}

// ---- enqueue: refuses malformed runtime shapes without touching memory -----------------------

// The pointers are distinct and non-null (small host buffers, never dereferenced by the plugin on
// the host): null pointers would make checkParams return kNULL_POINTER for every case and mask which
// check refused. Each case must get enqueue's own status and a message naming its cause.
void testEnqueue(IPluginV3OneRuntime* rt, RecordingLogger& logger)
{
    alignas(16) static unsigned char dummy[7][64];
    void const* inputs[5] = {dummy[0], dummy[1], dummy[2], dummy[3], dummy[4]};
    void* outputs[2] = {dummy[5], dummy[6]};
    void const* nullInputs[5] = {nullptr, nullptr, nullptr, nullptr, nullptr};
    void* nullOutputs[2] = {nullptr, nullptr};
    constexpr int32_t kBadShape = 2;    // qkrope::Status::kBAD_SHAPE (enqueue's own refusals)
    constexpr int32_t kNullPointer = 1; // qkrope::Status::kNULL_POINTER
    struct Case
    {
        char const* name;
        Shapes s;
        DataType cacheType;
        int32_t status;
        std::vector<char const*> needles; // all must occur in the logged message
        bool nullPointers;
    };
    Shapes const base = goodShapes();
    auto with = [&](std::vector<int64_t> Shapes::*member, std::vector<int64_t> v) {
        Shapes s = base;
        s.*member = std::move(v);
        return s;
    };
    std::vector<Case> const cases = {
        {"cache_overflow", with(&Shapes::cache, {15, 128}), DataType::kFLOAT, kBadShape,
            {"overflow", "required rows (seq_len) = 16, cache rows = 15", "nothing was executed"}, false},
        {"rotary_odd", with(&Shapes::cache, {20, 127}), DataType::kFLOAT, kBadShape,
            {"rotary_dim 127", "expected an even value", "nothing was executed"}, false},
        {"rotary_gt_head_dim", with(&Shapes::cache, {20, 130}), DataType::kFLOAT, kBadShape,
            {"rotary_dim 130", "head_dim = 128", "nothing was executed"}, false},
        {"weight_length", with(&Shapes::kw, {64}), DataType::kFLOAT, kBadShape,
            {"k_weight has length 64", "expected head_dim = 128", "nothing was executed"}, false},
        {"qk_mismatch", with(&Shapes::k, {2, 16, 8, 128}), DataType::kFLOAT, kBadShape,
            {"same shape", "nothing was executed"}, false},
        {"cache_not_fp32", base, DataType::kHALF, kBadShape,
            {"unsupported dtypes", "cache float16", "nothing was executed"}, false},
        {"null_pointers", base, DataType::kFLOAT, kNullPointer, {"null"}, true},
    };
    for (auto const& cs : cases)
    {
        auto d = descs(cs.s, DataType::kHALF, cs.cacheType);
        size_t const mark = logger.mark();
        int32_t const rc = rt->enqueue(d.data(), d.data() + 5, cs.nullPointers ? nullInputs : inputs,
            cs.nullPointers ? nullOutputs : outputs, nullptr, nullptr);
        checkRefusal(std::string("enqueue.refuses.") + cs.name, rc, cs.status, logger, mark, cs.needles);
    }
    {
        // float32 weights are accepted under fp16 q only as a pair: a float32 q_weight beside an fp16
        // k_weight is refused before any launch
        auto d = descs(base, DataType::kHALF);
        d[2].type = DataType::kFLOAT;
        size_t const mark = logger.mark();
        int32_t const rc = rt->enqueue(d.data(), d.data() + 5, inputs, outputs, nullptr, nullptr);
        checkRefusal("enqueue.refuses.weights_of_two_dtypes", rc, kBadShape, logger, mark,
            {"unsupported dtypes", "weights float32/float16", "nothing was executed"});
    }
    for (BadRank const& b : badRankCases())
    {
        auto d = descs(base, DataType::kHALF);
        setRank(d[b.tensor].dims, b.nbDims);
        std::vector<char const*> needles = b.needles;
        needles.push_back("nothing was executed");
        size_t const mark = logger.mark();
        int32_t const rc = rt->enqueue(d.data(), d.data() + 5, inputs, outputs, nullptr, nullptr);
        checkRefusal(std::string("enqueue.refuses.") + b.name, rc, kBadShape, logger, mark, needles);
    }
    Shapes empty = base;
    empty.q = {0, 16, 4, 128};
    empty.k = {0, 16, 4, 128};
    auto d = descs(empty, DataType::kHALF);
    check(rt->enqueue(d.data(), d.data() + 5, nullInputs, nullOutputs, nullptr, nullptr) == 0,
        "enqueue.empty_batch_noop", logger.lastSince(0));
}

// ---- serialize: getFieldsToSerialize -> createPlugin(kRUNTIME) round trip --------------------

void testSerialize(IPluginCreatorV3One* c, RecordingLogger& logger)
{
    Fields f = parserFields(3e-5F, 0, 1);
    PluginPtr q = createFor("serialize", c, &f, logger);
    if (q == nullptr)
    {
        return;
    }
    PluginFieldCollection const* fc = runtimeOf(q.get())->getFieldsToSerialize();
    bool const typesOk = fc != nullptr && fc->nbFields == 4;
    for (int32_t i = 0; typesOk && i < 4; ++i)
    {
        std::printf("SERIALIZED %s %s %d\n", fc->fields[i].name, fieldTypeName(fc->fields[i].type),
            fc->fields[i].length);
    }
    check(typesOk, "serialize.fields", fc ? std::to_string(fc->nbFields) : "null");
    // Copy as TensorRT would into the plan (every serialised field is 4 bytes an element), then
    // recreate from the copy; `count` fields only: an engine serialised before norm_scope existed
    // holds epsilon, interleaved and rounding, and must load with norm_scope 0.
    auto copyOf = [](PluginFieldCollection const* from, int32_t count) {
        Fields copy;
        for (int32_t i = 0; from && i < count && i < from->nbFields; ++i)
        {
            auto const* data = static_cast<char const*>(from->fields[i].data);
            std::vector<char> bytes(data, data + 4 * static_cast<size_t>(from->fields[i].length));
            copy.raw(from->fields[i].name, bytes, from->fields[i].type, from->fields[i].length);
        }
        return copy;
    };
    Fields copy = copyOf(fc, 4);
    PluginPtr r = create(c, &copy, TensorRTPhase::kRUNTIME, "deserialized");
    check(r != nullptr && serializedAttrs(r.get()).equals(3e-5F, 0, 1), "serialize.roundtrip", describe(r.get(), logger));
    Fields before = copyOf(fc, 3);
    PluginPtr old = create(c, &before, TensorRTPhase::kRUNTIME, "deserialized_v1");
    check(old != nullptr && serializedAttrs(old.get()).equals(3e-5F, 0, 1, 0), "serialize.engine_without_norm_scope",
        describe(old.get(), logger));

    // norm_scope 1 (a Wan node) survives the round trip.
    Fields rowFields = parserFields(1e-6F, 1, 2);
    rowFields.add("norm_scope", int32_t{1}, PluginFieldType::kINT32);
    PluginPtr row = createFor("serialize", c, &rowFields, logger);
    if (row != nullptr)
    {
        Fields rowCopy = copyOf(runtimeOf(row.get())->getFieldsToSerialize(), 4);
        PluginPtr back = create(c, &rowCopy, TensorRTPhase::kRUNTIME, "deserialized_row");
        check(back != nullptr && serializedAttrs(back.get()).equals(1e-6F, 1, 2, 1), "serialize.roundtrip_norm_scope",
            describe(back.get(), logger));
    }
}

// ---- clone: complete and independent ----------------------------------------------------------

void testClone(IPluginCreatorV3One* c, RecordingLogger& logger)
{
    Fields f = parserFields(3e-5F, 0, 1);
    PluginPtr q = createFor("clone", c, &f, logger);
    if (q == nullptr)
    {
        return;
    }
    PluginPtr cl(q->clone());
    check(cl != nullptr && cl != q && serializedAttrs(cl.get()).equals(3e-5F, 0, 1) && coreOf(cl.get()) != nullptr
            && buildOf(cl.get()) != nullptr && runtimeOf(cl.get()) != nullptr,
        "clone.complete", cl ? serializedAttrs(cl.get()).str() : "null");
    // The clone's serialized fields must point into the clone, not into q.
    PluginFieldCollection const* fq = runtimeOf(q.get())->getFieldsToSerialize();
    PluginFieldCollection const* fcl = cl ? runtimeOf(cl.get())->getFieldsToSerialize() : nullptr;
    check(fcl != nullptr && fq != nullptr && fcl->fields[0].data != fq->fields[0].data, "clone.independent");
    q.reset(); // the clone must outlive its source
    check(cl != nullptr && serializedAttrs(cl.get()).equals(3e-5F, 0, 1), "clone.outlives_source");
}

// ---- attach_to_context: a complete clone --------------------------------------------------------

void testAttachToContext(IPluginCreatorV3One* c, RecordingLogger& logger)
{
    Fields f = parserFields(3e-5F, 0, 1);
    PluginPtr q = createFor("attach_to_context", c, &f, logger);
    if (q == nullptr)
    {
        return;
    }
    PluginPtr att(runtimeOf(q.get())->attachToContext(nullptr));
    bool const distinct = att != q;
    q.reset(); // the attached plugin must outlive its source
    check(att != nullptr && distinct && serializedAttrs(att.get()).equals(3e-5F, 0, 1) && buildOf(att.get()) != nullptr,
        "attach_to_context.complete");
}

} // namespace qkrope_host_test
