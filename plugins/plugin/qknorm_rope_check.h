// qkrope: how the plugin refuses bad input. Every entry point TensorRT calls is noexcept; its body
// runs inside guarded(), which turns a refusal (QKROPE_VALIDATE -> PluginError) or any other
// exception into one logged message and the entry point's failure value. This replaces a
// try/catch in every method (TensorRT OSS: PLUGIN_VALIDATE and caughtError in plugin/common/).
#pragma once

#include <cstdint>
#include <exception>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>

namespace qkrope
{
namespace plugin
{

// A refused input. `status` is what an int32_t-returning entry point returns for it (1 unless the
// entry point has its own codes, as enqueue has).
class PluginError : public std::runtime_error
{
public:
    explicit PluginError(std::string const& what, int32_t status = 1)
        : std::runtime_error(what)
        , mStatus(status)
    {
    }
    int32_t status() const noexcept
    {
        return mStatus;
    }

private:
    int32_t mStatus;
};

// Refuses unless `cond`; `...` (a std::string expression, and optionally a status) is only
// evaluated when refusing.
#define QKROPE_VALIDATE(cond, ...)                                                                                     \
    do                                                                                                                 \
    {                                                                                                                  \
        if (!(cond))                                                                                                   \
        {                                                                                                              \
            throw ::qkrope::plugin::PluginError(__VA_ARGS__);                                                         \
        }                                                                                                              \
    } while (0)

// Runs body() and returns its result. When it throws, report(message) is called once and
// `failure` is returned (for an int32_t result: the PluginError's status). The message is the
// PluginError's text, or "internal error (<what>)" for anything else. When report itself throws
// (no memory for the message), fallback() is called instead; it must not throw.
template <typename R, typename Body, typename Report, typename Fallback>
R guarded(R failure, Body&& body, Report&& report, Fallback&& fallback) noexcept
{
    static_assert(std::is_nothrow_invocable_v<Fallback>, "the fallback reporter must be noexcept");
    auto say = [&](char const* prefix, char const* what) noexcept {
        try
        {
            report(std::string(prefix) + what + (*prefix ? ")" : ""));
        }
        catch (...)
        {
            fallback();
        }
    };
    try
    {
        return body();
    }
    catch (PluginError const& e)
    {
        say("", e.what());
        if constexpr (std::is_same_v<R, int32_t>)
        {
            return e.status();
        }
    }
    catch (std::exception const& e)
    {
        say("internal error (", e.what());
    }
    catch (...)
    {
        say("internal error (", "unknown exception");
    }
    return failure;
}

} // namespace plugin
} // namespace qkrope
