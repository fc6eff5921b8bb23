"""Everything the kernel report assumes, in one place: the hardware figures per SM architecture,
the problem the bounds are stated for, the per-token instruction thresholds, the modelled
devices the real launcher is run against, the launches (each family record's ``launches``) and
their static targets; and the arithmetic on them (occupancy, the issue and memory floors, the assumptions as
the report prints them)."""
from __future__ import annotations

import math

from qkrope import families

# Hardware figures per SM architecture. Figures marked "assumed" are not read from any device:
# they are public nominal numbers (or plain estimates) and only scale the printed bounds; no
# --check depends on them.
HARDWARE = {
    90: {
        "gpu": "H200 SXM",
        "sms": 132,
        "schedulers_per_sm": 4,          # 1 warp-instruction issued per scheduler per cycle
        "clock_ghz": 1.98,               # assumed: boost clock; under load it may be lower
        "dram_tb_s": 4.8,                # nominal HBM3e bandwidth
        "dram_latency_ns": 1000,         # assumed: loaded DRAM latency, the launch plan's figure
                                         # (qknorm_rope_plan.h dramLatencyNs; ~0.8-1 us on Hopper)
        "regs_per_sm": 65536,
        "reg_alloc_unit_per_warp": 256,  # registers are allocated per warp in units of 256
        "max_regs_per_thread": 255,
        "max_warps_per_sm": 64,          # 2048 threads
        "max_blocks_per_sm": 32,
        "smem_per_sm": 228 * 1024,
        "smem_reserved_per_block": 1024,  # the driver's per-block system reservation
        "smem_max_per_block": 227 * 1024,
    },
    100: {
        "gpu": "B200 (assumed figures)",
        "sms": 148,                      # assumed
        "schedulers_per_sm": 4,
        "clock_ghz": 1.9,                # assumed
        "dram_tb_s": 8.0,                # assumed: nominal HBM3e bandwidth
        "dram_latency_ns": 1000,         # assumed: the launch plan's figure (dramLatencyNs)
        "regs_per_sm": 65536,
        "reg_alloc_unit_per_warp": 256,
        "max_regs_per_thread": 255,
        "max_warps_per_sm": 64,
        "max_blocks_per_sm": 32,
        "smem_per_sm": 228 * 1024,
        "smem_reserved_per_block": 1024,
        "smem_max_per_block": 227 * 1024,
    },
}

# The problem the bounds are stated for: one joint-attention block at 1024x1024, both streams
# (4096 image + 512 text tokens), 24 heads of 128 at full rotary width, bf16, one fp32 cache row
# per token (the default family's block; FLUX.1's double-stream block has the same shape).
PROBLEM = {
    "name": "one block at 1024x1024: 4096 image + 512 text tokens, 24 heads x 128, bf16",
    "tokens": 4096 + 512,
    "heads": 24,
    "head_dim": 128,
    "rotary_dim": 128,
    "elem_bytes": 2,
    "cache_value_bytes": 4,
}

# Per-token threshold on the bf16 x 128 interleaved instances (one loop iteration along the common path per
# element; DESIGN.md: "<= 20 SASS instructions per element (26 with rounding=1)"). Key: rounding.
# rounding=2 (torch's RMSNorm order) does rounding=0's work plus one round trip of x*inv*w to bf16 before
# the rotation: one pack (F2F.BF16X2) and two unpacks per pair, 1.5 instructions per element (the
# sm_90 SASS measures +1.5 in the rows-1 instance, +1.4 and +1.1 in rows 2 and 3, where ptxas
# folds some unpacks into their uses), so its limit is 20 + 1.5.
ROUNDING2_COST = 1.5
THRESHOLDS = {0: 20, 1: 26, 2: 20 + ROUNDING2_COST}
THRESHOLD_SOURCE = ('DESIGN.md: "<= 20 SASS instructions per element (26 with rounding=1)"; '
                    f'rounding=2: 20 + {ROUNDING2_COST} for its one rounding round trip')

# Modelled GPUs the real launcher is run against (through the SIMT emulation's modelled device,
# in dry-run mode): what cudaDeviceGetAttribute answers there. Memory clock x bus width gives the
# nominal DRAM bandwidth (2 x clock x width / 8): H100 SXM 3.35 TB/s, H200 4.8, B200 8.0, L40S
# 0.864, A100 80GB 2.04. Public nominal figures, not read from a device.
MODELLED_DEVICES = {
    "H100 SXM": {"arch": 90, "sms": 132, "cc": (9, 0), "max_threads_per_sm": 2048, "max_blocks_per_sm": 32,
                 "clock_khz": 1980000, "mem_clock_khz": 2619000, "bus_width_bits": 5120},
    "H200 SXM": {"arch": 90, "sms": 132, "cc": (9, 0), "max_threads_per_sm": 2048, "max_blocks_per_sm": 32,
                 "clock_khz": 1980000, "mem_clock_khz": 3125000, "bus_width_bits": 6144},
    "B200": {"arch": 100, "sms": 148, "cc": (10, 0), "max_threads_per_sm": 2048, "max_blocks_per_sm": 32,
             "clock_khz": 1965000, "mem_clock_khz": 3906000, "bus_width_bits": 8192},
    "L40S": {"arch": 89, "sms": 142, "cc": (8, 9), "max_threads_per_sm": 1536, "max_blocks_per_sm": 24,
             "clock_khz": 2520000, "mem_clock_khz": 9000000, "bus_width_bits": 384},
    "A100 SXM 80GB": {"arch": 80, "sms": 108, "cc": (8, 0), "max_threads_per_sm": 2048,
                      "max_blocks_per_sm": 32, "clock_khz": 1410000, "mem_clock_khz": 1593000,
                      "bus_width_bits": 5120},
}
# Static targets of a launched instance on an sm_90 device (H100/H200), by the launch's
# tokens (batch x sequence): global read bytes (q/k rows and cos/sin) still outstanding per SM past
# every wait of the steady-state token loop, read from the SASS scoreboards (the fewest at any
# wait x resident threads; kernel_report.sass.scoreboards), and
# whole-kernel common-path SASS instructions per element by rounding mode. The bytes: issue 31's
# targets, >= 32 KiB at 4096+ tokens (Little's law at 4.8 TB/s over 132 SMs: 90 % of peak needs
# 26-32 KiB per SM in flight at 0.8-1 us of loaded latency), >= 16 KiB below.
# rounding 2 keeps rounding 0's whole-kernel limits: the instances launched at 4096+ tokens
# (rows 2 and 3) absorb its 1.5 extra per element (19.7 at most, H100, 24 heads x 4096 image
# tokens); only the rows-1 instance's per-token figure needs THRESHOLDS' 21.5.
LAUNCH_TARGETS = (
    {"min_tokens": 4096, "bytes_in_flight_per_sm": 32 * 1024, "instr_per_element": {0: 20, 1: 26, 2: 20}},
    {"min_tokens": 0, "bytes_in_flight_per_sm": 16 * 1024, "instr_per_element": {0: 26, 1: 26, 2: 26}},
)
# The whole-kernel figure describes a group in its steady state: the ring keeps kPlanPrefetch
# (qknorm_rope_plan.h, 2) tokens of rows outstanding past each wait, and the prologue (the weights,
# the ring's first groups: 216-258 instructions per thread) is spread over the group's tokens. A
# launch whose plan gives its groups fewer tokens than the ring holds (a short text stream over
# every SM: 128-256 tokens x 24-28 heads walk 1.0-1.7 tokens per group on sm_90) never leaves the
# ring's fill, and its whole-kernel figure is that prologue over one or two tokens whatever the
# loop does. Spreading it over fewer groups would leave SMs idle for a launch the DRAM latency
# already bounds (the plan's time model picks the spread). Those launches are held to the per-token
# loop figure, THRESHOLDS (DESIGN.md's per-element numbers), instead of the whole-kernel one.
STEADY_TOKENS_PER_GROUP = 2
TARGET_ARCHS = (90,)


# The reference instances: the fast-path instances the default family's launches run (the
# family PROBLEM is the block of), picked out by the template parameters with these roles. The
# type is the report's own (bf16 activations, PROBLEM's element size), not a launch's.
REFERENCE_TYPE = "Bf16"


def reference_match(record=None) -> dict[str, tuple[str, ...]]:
    """The role values of the reference instances, from ``record``'s launches (default: the
    default family's) with a per-head norm (norm_scope 0, the fast path): each role -> the
    values any of them has (head_dim, interleaved, full_rotary as the demangled names spell
    them: "128", "true")."""
    record = record if record is not None else families.default()
    launches = [ln for ln in record.launches if ln.norm_scope == 0]
    if not launches:
        raise ValueError(f"{record.name}: no per-head launch (norm_scope 0) to take the kernel "
                         "report's reference instances from; give the record launches")

    def values(of) -> tuple[str, ...]:
        return tuple(sorted({str(of(ln)).lower() for ln in launches}))

    return {"type": (REFERENCE_TYPE,), "head_dim": values(lambda ln: ln.head_dim),
            "interleaved": values(lambda ln: ln.interleaved),
            "full_rotary": values(lambda ln: ln.rotary == ln.head_dim)}


def launch_target(tokens: int) -> dict:
    return next(t for t in LAUNCH_TARGETS if tokens >= t["min_tokens"])


def launch_problems() -> list[dict]:
    """Every launch the report plans on each modelled device, from each family record's
    ``launches`` in registry order (one shape shared by two records is planned once): model,
    stream, batch, seq, tokens, heads, head_dim, rotary_dim, interleaved, roundings, norm_scope
    (with norm_scope 1 the weights are [heads * head_dim])."""
    out, seen = [], set()
    for record in families.records():
        for ln in record.launches:
            for batch in ln.batches:
                key = (ln.model, ln.stream, batch)
                if key in seen:
                    continue
                seen.add(key)
                out.append({"model": ln.model, "stream": ln.stream, "batch": batch,
                            "seq": ln.seq, "tokens": batch * ln.seq, "heads": ln.heads,
                            "head_dim": ln.head_dim, "rotary_dim": ln.rotary,
                            "interleaved": ln.interleaved, "roundings": ln.roundings,
                            "norm_scope": ln.norm_scope})
    return out


def occupancy(regs: int, smem_static: int, threads: int, hw: dict) -> dict:
    """Resident blocks per SM from registers (per-warp allocation rounded up to the unit), shared
    memory (static + the per-block reservation; dynamic shared memory is 0 for these kernels),
    threads, and the block limit."""
    warps = max(1, math.ceil(threads / 32))
    unit = hw["reg_alloc_unit_per_warp"]
    per_warp = math.ceil(max(regs, 1) * 32 / unit) * unit
    limits = {
        "registers": hw["regs_per_sm"] // (per_warp * warps),
        "shared memory": hw["smem_per_sm"] // (smem_static + hw["smem_reserved_per_block"]),
        "threads": hw["max_warps_per_sm"] // warps,
        "blocks": hw["max_blocks_per_sm"],
    }
    if smem_static > hw["smem_max_per_block"]:
        limits["shared memory"] = 0
    blocks = min(limits.values())
    limiter = min(limits, key=lambda k: (limits[k], k != "registers"))
    return {"blocks_per_sm": blocks, "threads_per_sm": blocks * threads,
            "occupancy": blocks * warps / hw["max_warps_per_sm"], "limiter": limiter,
            "limits": limits}


def problem_bounds(instr_per_element: float | None, bytes_per_thread: float, threads_per_sm: int,
                hw: dict, problem: dict = PROBLEM) -> dict:
    """Issue-rate floor vs memory floor for PROBLEM, and bytes in flight per SM vs the GPU's
    bandwidth-latency product per SM."""
    p = problem
    tensor_bytes = p["tokens"] * p["heads"] * p["head_dim"] * p["elem_bytes"] * 4  # q, k in; q, k out
    cache_bytes = p["tokens"] * p["rotary_dim"] * p["cache_value_bytes"]
    total = tensor_bytes + cache_bytes
    bw = hw["dram_tb_s"] * 1e12
    mem_us = total / bw * 1e6
    elements = p["tokens"] * 2 * p["heads"] * p["head_dim"]
    out = {"bytes": total, "memory_floor_us": mem_us, "elements": elements}
    issue_rate = hw["sms"] * hw["schedulers_per_sm"] * hw["clock_ghz"] * 1e9  # warp-instr / s
    if instr_per_element:
        warp_instr = elements / 32 * instr_per_element
        issue_us = warp_instr / issue_rate * 1e6
        out.update(warp_instructions=warp_instr, issue_floor_us=issue_us,
                   bound="issue rate" if issue_us > mem_us else "memory",
                   floor_us=max(issue_us, mem_us),
                   fraction_of_peak_bw=mem_us / max(issue_us, mem_us),
                   break_even_instr_per_element=mem_us * 1e-6 * issue_rate * 32 / elements)
    need = bw * hw["dram_latency_ns"] * 1e-9 / hw["sms"]
    have = bytes_per_thread * threads_per_sm
    out.update(bytes_in_flight_needed_per_sm=need, bytes_in_flight_per_sm=have,
               in_flight_ratio=have / need if need else None,
               latency_bound_read_tb_s=have * hw["sms"] / (hw["dram_latency_ns"] * 1e-9) / 1e12)
    return out


def assumptions(arch: int) -> list[str]:
    hw = HARDWARE.get(arch, HARDWARE[90])
    p = PROBLEM
    return [
        f"hardware sm_{arch}: {hw['gpu']}, {hw['sms']} SMs, {hw['schedulers_per_sm']} schedulers/SM "
        f"issuing 1 warp-instruction/cycle each at {hw['clock_ghz']} GHz, {hw['dram_tb_s']} TB/s DRAM, "
        f"{hw['dram_latency_ns']} ns loaded DRAM latency (clock, latency"
        f"{', and for sm_100 all figures' if arch >= 100 else ''} are assumptions)",
        f"problem: {p['name']}; bytes = tokens x heads x head_dim x {p['elem_bytes']} B x 4 tensors "
        f"(q, k read; q_out, k_out written) + tokens x rotary_dim x {p['cache_value_bytes']} B cache; "
        "weights negligible",
        "issue floor = elements / 32 x instructions per element / (SMs x schedulers x clock): assumes "
        "perfect issue (no stalls, no dual-issue) and that the hot loop is all the work",
        "instructions per element = non-NOP SASS instructions from the hot-loop head to its back edge "
        "inclusive / elements stored per iteration (global store bytes in the loop / element size; "
        "each output element is stored exactly once); cold paths (IEEE div/sqrt slow paths) are "
        "assumed to sit outside the loop's address range (CALL.REL to subroutines after EXIT), so "
        "the count is the common path plus branch-arounds; 'skipped' counts the in-range "
        "instructions some forward branch jumps over (an upper bound on that error), 'longest "
        "path' the most instructions on one head-to-back-edge path",
        "loads in flight: a load is outstanding from issue until the first instruction that reads "
        "or overwrites its destination registers, walking the loop body twice in address order "
        "(ignores branches and scoreboard details); bytes in flight per SM = max outstanding "
        "128-bit q/k loads x 16 B x resident threads per SM",
        "bytes in flight needed per SM = bandwidth x latency / SMs (Little's law, counting all "
        "traffic as reads: conservative, stores are posted)",
        "occupancy: registers allocated per warp in units of "
        f"{hw['reg_alloc_unit_per_warp']}, {hw['regs_per_sm']} registers, {hw['max_warps_per_sm']} "
        f"warps, {hw['max_blocks_per_sm']} blocks, {hw['smem_per_sm'] // 1024} KiB shared memory "
        f"per SM with {hw['smem_reserved_per_block']} B reserved per block, no dynamic shared memory",
    ]


def device_hardware(name: str) -> dict:
    """The occupancy figures of a modelled device (register file, warps, blocks, shared memory)."""
    dev = MODELLED_DEVICES[name]
    hw = dict(HARDWARE.get(dev["arch"], HARDWARE[90]))
    hw.update(gpu=name, sms=dev["sms"], max_warps_per_sm=dev["max_threads_per_sm"] // 32,
              max_blocks_per_sm=dev["max_blocks_per_sm"])
    return hw
