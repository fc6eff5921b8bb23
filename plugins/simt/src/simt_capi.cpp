// SIMT emulation: the C control API (simt_capi.h), and its former names as aliases.
#include "simt_capi.h"

#include "simt_internal.h"

#include <dlfcn.h>

#include <cinttypes>
#include <cstdio>
#include <sstream>

using simt::internal::demangle;
using simt::internal::G;
using simt::internal::symtabOf;

namespace
{

std::string jsonString(std::string const& s)
{
    std::string out = "\"";
    for (char c : s)
    {
        switch (c)
        {
        case '"': out += "\\\""; break;
        case '\\': out += "\\\\"; break;
        case '\n': out += "\\n"; break;
        case '\t': out += "\\t"; break;
        default:
            if (static_cast<unsigned char>(c) < 0x20)
            {
                char buf[8];
                std::snprintf(buf, sizeof(buf), "\\u%04x", c);
                out += buf;
            }
            else
            {
                out += c;
            }
        }
    }
    return out + "\"";
}

std::string configJson()
{
    simt::DeviceConfig const c = simt::currentConfig();
    int device = 0;
    (void) cudaGetDevice(&device);
    std::size_t stack;
    {
        std::lock_guard<std::mutex> lock(G().mu);
        stack = G().stackSize;
    }
    bool dry;
    {
        std::lock_guard<std::mutex> lock(G().mu);
        dry = G().dryRun;
    }
    char buf[256];
    std::snprintf(buf, sizeof(buf),
        "{\"device\": %d, \"num_sms\": %d, \"blocks_per_sm\": %d, \"max_threads_per_sm\": %d, \"seed\": %" PRIu64
        ", \"stack_bytes\": %zu, \"dry_run\": %s}",
        device, c.numSms, c.blocksPerSm, c.maxThreadsPerSm, simt::currentSeed(), stack, dry ? "true" : "false");
    return buf;
}

} // namespace

extern "C"
{

int32_t simt_configure(int32_t num_sms, int32_t blocks_per_sm, int64_t seed)
{
    simt::DeviceConfig cfg = simt::currentConfig();
    if (num_sms >= 0)
    {
        cfg.numSms = num_sms;
    }
    if (blocks_per_sm >= 0)
    {
        cfg.blocksPerSm = blocks_per_sm;
    }
    uint64_t const s = seed >= 0 ? static_cast<uint64_t>(seed) : simt::currentSeed();
    return simt::configure(cfg, s);
}

int32_t simt_configure_model(int32_t num_sms, int32_t max_threads_per_sm, int32_t cc_major,
    int32_t cc_minor, int32_t clock_khz, int32_t mem_clock_khz, int32_t bus_width_bits, char const* occupancy,
    int64_t seed)
{
    simt::DeviceConfig cfg = simt::currentConfig();
    if (cc_major < 1 || cc_minor < 0 || clock_khz <= 0 || mem_clock_khz <= 0 || bus_width_bits <= 0)
    {
        return -1;
    }
    cfg.numSms = num_sms;
    cfg.maxThreadsPerSm = max_threads_per_sm;
    cfg.ccMajor = cc_major;
    cfg.ccMinor = cc_minor;
    cfg.clockKHz = clock_khz;
    cfg.memClockKHz = mem_clock_khz;
    cfg.busWidthBits = bus_width_bits;
    cfg.occupancy.clear();
    for (char const* line = occupancy; line != nullptr && *line != '\0';)
    {
        char const* const end = std::strchr(line, '\n');
        std::string const text(line, end != nullptr ? static_cast<std::size_t>(end - line) : std::strlen(line));
        line = end != nullptr ? end + 1 : nullptr;
        if (text.empty())
        {
            continue;
        }
        std::size_t const tab = text.rfind('\t');
        if (tab == std::string::npos || tab == 0)
        {
            return -1;
        }
        char* stop = nullptr;
        long const blocks = std::strtol(text.c_str() + tab + 1, &stop, 10);
        if (stop == text.c_str() + tab + 1 || *stop != '\0' || blocks < 0 || blocks > 64)
        {
            return -1;
        }
        cfg.occupancy[text.substr(0, tab)] = static_cast<int>(blocks);
    }
    uint64_t const s = seed >= 0 ? static_cast<uint64_t>(seed) : simt::currentSeed();
    return simt::configure(cfg, s);
}

char const* simt_config_json(void)
{
    thread_local std::string out;
    out = configJson();
    return out.c_str();
}

int32_t simt_set_stack_size(int64_t bytes)
{
    if (bytes < 16 * 1024 || bytes > (int64_t{1} << 26))
    {
        return -1;
    }
    simt::setStackSize(static_cast<std::size_t>(bytes));
    return 0;
}

char const* simt_last_error(void)
{
    return simt::lastErrorMessage();
}

int32_t simt_peek_error(void)
{
    return static_cast<int32_t>(cudaPeekAtLastError());
}

void simt_set_pending_error(int32_t error)
{
    simt::detail::setLastError(static_cast<cudaError_t>(error));
}

void simt_reset(void)
{
    simt::clearStats();
    (void) cudaGetLastError();
}

int64_t simt_launch_count(void)
{
    std::lock_guard<std::mutex> lock(G().mu);
    return static_cast<int64_t>(G().records.size());
}

char const* simt_launches_json(void)
{
    thread_local std::string out;
    std::ostringstream s;
    std::lock_guard<std::mutex> lock(G().mu);
    s << "[";
    bool first = true;
    for (auto const& r : G().records)
    {
        s << (first ? "" : ",\n") << "{\"seq\": " << r.seq << ", \"kernel\": " << jsonString(r.kernel)
          << ", \"grid\": [" << r.grid.x << ", " << r.grid.y << ", " << r.grid.z << "], \"block\": [" << r.block.x
          << ", " << r.block.y << ", " << r.block.z << "], \"smem\": " << r.smem << ", \"device\": " << r.device
          << ", \"num_sms\": " << r.config.numSms << ", \"blocks_per_sm\": " << r.config.blocksPerSm
          << ", \"seed\": " << r.seed << ", \"status\": " << r.status << ", \"error\": " << jsonString(r.error)
          << ", \"blocks_run\": " << r.blocksRun << ", \"collectives\": " << r.collectives
          << ", \"barriers\": " << r.barriers << "}";
        first = false;
    }
    s << "]";
    out = s.str();
    return out.c_str();
}

char const* simt_symbols_json(char const* substring)
{
    thread_local std::string out;
    std::string const needle = substring != nullptr ? substring : "";
    Dl_info info{};
    std::ostringstream s;
    s << "[";
    if (dladdr(reinterpret_cast<void const*>(&simt_symbols_json), &info) != 0 && info.dli_fname != nullptr)
    {
        std::lock_guard<std::mutex> lock(G().mu);
        bool first = true;
        for (auto const& kv : symtabOf(info.dli_fname))
        {
            std::string const d = demangle(kv.second.c_str());
            if (d.find(needle) != std::string::npos && kv.second.find('.') == std::string::npos)
            {
                s << (first ? "" : ", ") << jsonString(d);
                first = false;
            }
        }
    }
    s << "]";
    out = s.str();
    return out.c_str();
}

void simt_set_dry_run(int32_t on)
{
    std::lock_guard<std::mutex> lock(G().mu);
    G().dryRun = on != 0;
}

void simt_set_strict_exit(int32_t on)
{
    std::lock_guard<std::mutex> lock(G().mu);
    G().strictExit = on != 0;
}

int32_t simt_version(void)
{
    return 1;
}

} // extern "C"

// The former names: the same functions under a second symbol (simt_capi.h, deprecated).
#define SIMT_ALIAS(old_name, new_name) extern "C" decltype(new_name) old_name __attribute__((alias(#new_name)));
SIMT_ALIAS(qkrope_simt_configure, simt_configure)
SIMT_ALIAS(qkrope_simt_configure_model, simt_configure_model)
SIMT_ALIAS(qkrope_simt_config_json, simt_config_json)
SIMT_ALIAS(qkrope_simt_set_stack_size, simt_set_stack_size)
SIMT_ALIAS(qkrope_simt_last_error, simt_last_error)
SIMT_ALIAS(qkrope_simt_peek_error, simt_peek_error)
SIMT_ALIAS(qkrope_simt_set_pending_error, simt_set_pending_error)
SIMT_ALIAS(qkrope_simt_reset, simt_reset)
SIMT_ALIAS(qkrope_simt_launch_count, simt_launch_count)
SIMT_ALIAS(qkrope_simt_launches_json, simt_launches_json)
SIMT_ALIAS(qkrope_simt_symbols_json, simt_symbols_json)
SIMT_ALIAS(qkrope_simt_set_dry_run, simt_set_dry_run)
SIMT_ALIAS(qkrope_simt_set_strict_exit, simt_set_strict_exit)
SIMT_ALIAS(qkrope_simt_version, simt_version)
#undef SIMT_ALIAS
