// qkrope fuzz target: the tensor descriptors (Dims, DataType, TensorFormat) decoded from the input and
// the reference model of the plugin's shape and dtype rules. Overview: plugin_fuzz.cpp.
#include "plugin_fuzz.h"

#include <limits>

namespace qkrope_fuzz
{

// ---- tensor descriptors -----------------------------------------------------------------------------

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

namespace
{

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

} // namespace

// q, k, q_weight, k_weight, cos_sin_cache, q_out, k_out: a valid problem, then perturbed.
void makeDims(Input& in, Problem const& p, Dims (&d)[7], bool allowWildcards, int32_t normScope)
{
    int64_t const width = normScope == qkrope::kNORM_SCOPE_ROW ? p.heads * p.headDim : p.headDim;
    std::vector<int64_t> const shapes[7] = {{p.batch, p.seq, p.heads, p.headDim}, {p.batch, p.seq, p.heads, p.headDim},
        {width}, {width}, {p.rows, p.rot}, {p.batch, p.seq, p.heads, p.headDim},
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

namespace
{

DataType pickType(Input& in)
{
    static DataType const kCommon[] = {DataType::kHALF, DataType::kBF16, DataType::kFLOAT};
    if (in.chance(220) || !in.chance(255))
    {
        return kCommon[in.below(3)];
    }
    return static_cast<DataType>(in.below(static_cast<uint32_t>(EnumMax<DataType>())));
}

} // namespace

void makeTypes(Input& in, DataType (&t)[7])
{
    DataType const act = pickType(in);
    for (int i = 0; i < 7; ++i)
    {
        t[i] = i == 4 ? DataType::kFLOAT : act;
    }
    if (in.chance(48))
    {
        t[2] = t[3] = DataType::kFLOAT; // fp32 norm weights under q's type (a valid combination)
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
bool shapesConsistent(Dims const* d, int32_t normScope)
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
    int64_t const heads = known(d[0].d[2]) ? d[0].d[2] : d[1].d[2];
    if (normScope == qkrope::kNORM_SCOPE_ROW && known(heads) && known(head)
        && heads > std::numeric_limits<int64_t>::max() / head)
    {
        return false; // the row weights' length num_heads * head_dim is not an int64
    }
    int64_t const width = normScope == qkrope::kNORM_SCOPE_ROW ? (known(heads) && known(head) ? heads * head : -1) : head;
    for (int w : {2, 3})
    {
        if (known(width) && known(d[w].d[0]) && d[w].d[0] != width)
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

} // namespace qkrope_fuzz
