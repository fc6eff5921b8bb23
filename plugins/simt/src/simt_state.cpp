// SIMT emulation: the emulated devices, the emulator's settings and the launch log (one Global,
// guarded by its mutex), and the configuration functions of simt.h.
#include "simt_internal.h"

namespace simt
{
namespace internal
{

Global& G()
{
    static Global* g = new Global;
    return *g;
}

void recordLocked(LaunchRecord rec)
{
    rec.seq = ++G().seq;
    if (G().records.size() >= kMaxRecords)
    {
        G().records.pop_front();
    }
    G().records.push_back(std::move(rec));
}

DeviceConfig configOf(int device)
{
    Global& g = G();
    return device >= 0 && device < static_cast<int>(g.devices.size()) ? g.devices[static_cast<std::size_t>(device)]
                                                                       : DeviceConfig{};
}

} // namespace internal

using internal::configOf;
using internal::G;
using internal::Global;
using internal::kMaxDevices;

int configure(DeviceConfig const& cfg, uint64_t seed)
{
    if (cfg.numSms < 1 || cfg.numSms > 1024 || cfg.blocksPerSm < 1 || cfg.blocksPerSm > 64 || cfg.maxThreadsPerSm < 32)
    {
        return -1;
    }
    std::lock_guard<std::mutex> lock(G().mu);
    Global& g = G();
    int id = -1;
    for (std::size_t i = 0; i < g.devices.size(); ++i)
    {
        if (g.devices[i] == cfg)
        {
            id = static_cast<int>(i);
        }
    }
    if (id < 0)
    {
        if (static_cast<int>(g.devices.size()) >= kMaxDevices)
        {
            return -1;
        }
        g.devices.push_back(cfg);
        id = static_cast<int>(g.devices.size()) - 1;
    }
    g.current = id;
    g.seed = seed;
    return id;
}

DeviceConfig currentConfig()
{
    std::lock_guard<std::mutex> lock(G().mu);
    return configOf(G().current);
}

uint64_t currentSeed()
{
    std::lock_guard<std::mutex> lock(G().mu);
    return G().seed;
}

void setStackSize(std::size_t bytes)
{
    std::lock_guard<std::mutex> lock(G().mu);
    G().stackSize = bytes;
}

char const* lastErrorMessage()
{
    thread_local std::string copy;
    std::lock_guard<std::mutex> lock(G().mu);
    copy = G().lastMessage;
    return copy.c_str();
}

void clearStats()
{
    std::lock_guard<std::mutex> lock(G().mu);
    G().records.clear();
    G().lastMessage.clear();
    G().occupancyQueries.clear();
}

} // namespace simt
