// SIMT emulation: the C control API. Every library built with simt_add_emulated_library()
// (SimtEmulation.cmake) exports these functions beside its own C ABI, so a host program (or
// ctypes) that loads the library can shape the emulated device, pick the scheduling order and read
// what the launches did. Thread safety: the settings are process-wide; the last error and the
// pending CUDA error belong to the calling OS thread, as in CUDA.
#pragma once

#include <stdint.h>

#define SIMT_API __attribute__((visibility("default")))

#ifdef __cplusplus
extern "C"
{
#endif

// Selects the emulated device: num_sms / blocks_per_sm < 0 keep the current value; seed < 0 keeps
// the current seed (0 = round-robin order, else seeded random order). Returns the device id or -1.
SIMT_API int32_t simt_configure(int32_t num_sms, int32_t blocks_per_sm, int64_t seed);

// Selects a modelled device: its SM count, threads per SM, compute capability, SM and memory
// clocks (kHz) and bus width (what cudaDeviceGetAttribute answers), and the resident blocks per
// SM of named kernels (`occupancy`: lines "demangled kernel name<TAB>blocks", or NULL for none;
// other kernels keep the current blocks_per_sm). seed < 0 keeps the current seed. Returns the
// device id, or -1 for a value out of range or a malformed occupancy line.
SIMT_API int32_t simt_configure_model(int32_t num_sms, int32_t max_threads_per_sm, int32_t cc_major,
    int32_t cc_minor, int32_t clock_khz, int32_t mem_clock_khz, int32_t bus_width_bits, char const* occupancy,
    int64_t seed);

// The current device, seed, stack size and dry-run mode as a JSON object (valid until the calling
// thread's next call).
SIMT_API char const* simt_config_json(void);

// The stack of every fiber, in bytes (16 KiB .. 64 MiB; default 64 KiB). Returns 0, or -1 out of range.
SIMT_API int32_t simt_set_stack_size(int64_t bytes);

// The message of the last failing launch ("" if none since the last reset): kernel, block, warp,
// lanes, intrinsic and source line.
SIMT_API char const* simt_last_error(void);

// The calling thread's pending CUDA error (cudaPeekAtLastError), and a way to plant one: tests use
// it to check that a launch reports its own status and leaves an earlier error for its owner.
SIMT_API int32_t simt_peek_error(void);
SIMT_API void simt_set_pending_error(int32_t error);

// Clears the launch records and the last error message, and the calling thread's pending CUDA error.
SIMT_API void simt_reset(void);

// The number of launches recorded since the last reset.
SIMT_API int64_t simt_launch_count(void);

// The launches recorded since the last reset, oldest first, as a JSON array.
SIMT_API char const* simt_launches_json(void);

// Demangled names of the function symbols of this library whose name contains `substring`
// (the template instances that exist in the binary), as a JSON array.
SIMT_API char const* simt_symbols_json(char const* substring);

// 1: launches are checked and recorded but not run (outputs untouched); 0: launches run.
SIMT_API void simt_set_dry_run(int32_t on);

// 1: a mask naming a lane that exited (or does not exist) is reported as an error, although CUDA
// requires only the non-exited lanes of a mask to take part; 0 (default): CUDA's rule, and a
// shuffle reading such a lane is the error.
SIMT_API void simt_set_strict_exit(int32_t on);

// The version of this API (1).
SIMT_API int32_t simt_version(void);

// ---- deprecated: the former names ---------------------------------------------------------------
// Until the emulator had a prefix of its own, these functions were exported as qkrope_simt_*. The
// old names remain exported as aliases (the same function, the same address) for a while; new code
// calls simt_*. Each line: SIMT_DEPRECATED(<new name>) <the old name's declaration>.
#define SIMT_DEPRECATED(replacement) __attribute__((deprecated("use " #replacement)))
SIMT_API SIMT_DEPRECATED(simt_configure) int32_t qkrope_simt_configure(int32_t, int32_t, int64_t);
SIMT_API SIMT_DEPRECATED(simt_configure_model) int32_t qkrope_simt_configure_model(int32_t, int32_t, int32_t,
    int32_t, int32_t, int32_t, int32_t, char const*, int64_t);
SIMT_API SIMT_DEPRECATED(simt_config_json) char const* qkrope_simt_config_json(void);
SIMT_API SIMT_DEPRECATED(simt_set_stack_size) int32_t qkrope_simt_set_stack_size(int64_t);
SIMT_API SIMT_DEPRECATED(simt_last_error) char const* qkrope_simt_last_error(void);
SIMT_API SIMT_DEPRECATED(simt_peek_error) int32_t qkrope_simt_peek_error(void);
SIMT_API SIMT_DEPRECATED(simt_set_pending_error) void qkrope_simt_set_pending_error(int32_t);
SIMT_API SIMT_DEPRECATED(simt_reset) void qkrope_simt_reset(void);
SIMT_API SIMT_DEPRECATED(simt_launch_count) int64_t qkrope_simt_launch_count(void);
SIMT_API SIMT_DEPRECATED(simt_launches_json) char const* qkrope_simt_launches_json(void);
SIMT_API SIMT_DEPRECATED(simt_symbols_json) char const* qkrope_simt_symbols_json(char const*);
SIMT_API SIMT_DEPRECATED(simt_set_dry_run) void qkrope_simt_set_dry_run(int32_t);
SIMT_API SIMT_DEPRECATED(simt_set_strict_exit) void qkrope_simt_set_strict_exit(int32_t);
SIMT_API SIMT_DEPRECATED(simt_version) int32_t qkrope_simt_version(void);

#ifdef __cplusplus
} // extern "C"
#endif
