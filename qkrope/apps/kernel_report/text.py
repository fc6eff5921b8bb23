"""The report as text: per architecture the instance table, the detail blocks, the
assumptions; the launch table; the structural checks."""
from __future__ import annotations

import collections
import json

from .assumptions import (LAUNCH_TARGETS, STEADY_TOKENS_PER_GROUP, TARGET_ARCHS, THRESHOLD_SOURCE,
                          THRESHOLDS)
from .sass import outstanding_at_waits

def fmt(v, spec="", none="-"):
    return none if v is None else format(v, spec)


MAX_FAILURES_LISTED = 8


def format_text(report: dict, details: str = "reference") -> str:
    out: list[str] = []
    w = out.append
    for arch, entry in report["archs"].items():
        hw = entry["hardware"]
        w(f"== sm_{arch}  ({entry['cubin']}; hardware figures: {hw['gpu']})")
        for k, names in entry["param_names"].items():
            w(f"   {k}<{', '.join(names)}>  [{entry['param_origin'].get(k, '')}]")
        if not entry["ptxas"]:
            w("   no ptxas log (--cubin): registers/stack/shared from cuobjdump -res-usage, spills "
              "from LDL/STL in the SASS only")
        w("")
        hdr = (f"   {'instance':<34} {'regs':>4} {'spill st/ld':>11} {'stack':>5} {'smem':>6} "
               f"{'thr/blk':>7} {'blk/SM':>6} {'occ':>5} {'hot loop':>13} {'insns':>5} {'skip':>4} "
               f"{'el/it':>5} {'ins/el':>6} {'longest':>7} {'B@wait':>6} {'KiB/SM':>6}")
        w(hdr)
        for inst in entry["instances"]:
            lp = inst["hot_loop"]
            occ = inst["occupancy"]
            spill = f"{fmt(inst['spill_stores'])}/{fmt(inst['spill_loads'])}"
            label = inst["label"] + (" *ref" if inst["reference"] else "")
            if lp.get("found"):
                rng = f"{lp['head']}-{lp['end'][2:]}"
                least, _ = outstanding_at_waits(lp)
                kb = (least or 0) * occ["threads_per_sm"] / 1024
                loopcols = (f"{rng:>13} {lp['instructions']:>5} {lp['skipped_instructions']:>4} "
                            f"{fmt(lp['elements_per_iteration'], '.0f'):>5} "
                            f"{fmt(lp['instr_per_element'], '.2f'):>6} "
                            f"{fmt(lp['longest_path_per_element'], '.2f'):>7} {fmt(least):>6} {kb:>6.1f}")
            else:
                loopcols = f"{'(none)':>13}"
            w(f"   {label:<34} {inst['regs']:>4} {spill:>11} {fmt(inst['stack']):>5} {inst['smem']:>6} "
              f"{inst['threads_per_block']:>7} {occ['blocks_per_sm']:>6} {occ['occupancy'] * 100:>4.0f}% "
              + loopcols)
        w("   columns: spill in bytes (ptxas); occ = resident warps / 64; hot loop = SASS address range; "
          "insns = non-NOP instructions in it;")
        w("   skip = of those, ones a forward branch jumps over; el/it = elements stored per iteration; "
          "ins/el = insns / el/it;")
        w("   longest = instructions on the longest head-to-back-edge path per element; B@wait = global "
          "read bytes per thread still outstanding past")
        w("   every wait of the hot loop (the fewest; from the SASS scoreboards); KiB/SM = B@wait x "
          "resident threads per SM")
        w("")
        for inst in entry["instances"]:
            if inst["kind"] == "general" or not inst["hot_loop"].get("found"):
                continue
            if not (details == "all" or (details == "reference" and inst["reference"])):
                continue
            lp = inst["hot_loop"]
            params = ", ".join(f"{k}={v}" for k, v in inst["template_params"].items())
            w(f"   -- {inst['label']}  ({params}){'  [reference instance]' if inst['reference'] else ''}")
            w(f"      occupancy {inst['occupancy']['blocks_per_sm']} blocks x {inst['threads_per_block']} "
              f"threads ({inst['threads_source']}), limited by {inst['occupancy']['limiter']}; "
              f"{inst['regs']} registers")
            w(f"      hot loop {lp['head']}..{lp['end']}: {lp['instructions']} instructions "
              f"({lp['skipped_instructions']} in conditionally skipped blocks), {lp['stores_128']} x "
              f"STG.128 -> {lp['elements_per_iteration']:.0f} elements/iteration -> "
              f"{fmt(lp['instr_per_element'], '.2f')} instructions/element "
              f"(longest path {fmt(lp['longest_path_per_element'], '.2f')})")
            if inst["threshold"] is not None:
                w(f"      threshold {inst['threshold']}: {inst['threshold_note']}")
            mix = lp["mix"]["categories"]
            w("      mix: " + ", ".join(f"{k} {v}" for k, v in mix.items()))
            if lp["calls"]:
                where = ("all targets outside the loop" if lp["calls_outside_loop"]
                         else "SOME TARGETS INSIDE THE LOOP: the count includes them")
                w(f"      calls in the loop (cold subroutines, only the CALL counted): {len(lp['calls'])}, {where}")
            w("      global memory in the hot loop:")
            for o in lp["memory_ops"]:
                w(f"        {o['addr']}  {o['kind']:<5} {o['width']:>3}-bit  "
                  f"{'.'.join(o['qualifiers']) or '-':<14} {o['sass']}")
            sb = lp.get("scoreboards")
            if sb and sb["waits"]:
                w(f"      scoreboards: {sb['waits']} waits retire loads in the loop; global bytes per thread "
                  f"outstanding past them: fewest {sb['min_outstanding']}, average "
                  f"{sb['avg_outstanding']:.1f} (pending at them: fewest {sb['min_pending']}, average "
                  f"{sb['avg_pending']:.1f})")
                for wt in sb["waits_list"]:
                    w(f"        0x{wt['addr']:04x}  SB{','.join(map(str, wt['scoreboards'])):<5} "
                      f"{wt['pending']:>4} B -> {wt['outstanding']:>4} B  retires "
                      f"{', '.join(f'{n} {k}' for k, n in wt['retired'].items()):<18} {wt['sass']}")
            else:
                w("      scoreboards: no control bits or no wait in the loop")
            b = inst.get("bounds")
            if b:
                w(f"      bound ({report['problem']['name']}):")
                w(f"        memory floor   {b['bytes'] / 1e6:.1f} MB at {hw['dram_tb_s']} TB/s = "
                  f"{b['memory_floor_us']:.1f} us")
                if "issue_floor_us" in b:
                    w(f"        issue floor    {b['elements'] / 1e6:.1f} M elements / 32 x "
                      f"{lp['instr_per_element']:.2f} = {b['warp_instructions'] / 1e6:.1f} M warp-instr / "
                      f"({hw['sms']} SMs x {hw['schedulers_per_sm']} x {hw['clock_ghz']} GHz) = "
                      f"{b['issue_floor_us']:.1f} us  -> {b['bound']}-bound, at best "
                      f"{b['fraction_of_peak_bw'] * 100:.0f} % of peak bandwidth "
                      f"(break-even {b['break_even_instr_per_element']:.1f} instructions/element)")
                w(f"        in flight      {b['bytes_in_flight_per_sm'] / 1024:.1f} KB per SM past "
                  f"every wait ({fmt(outstanding_at_waits(lp)[0])} B x "
                  f"{inst['occupancy']['threads_per_sm']} threads) vs "
                  f"{b['bytes_in_flight_needed_per_sm'] / 1024:.1f} KB needed ({hw['dram_tb_s']} TB/s x "
                  f"{hw['dram_latency_ns']} ns / {hw['sms']} SMs): ratio {b['in_flight_ratio']:.2f}, "
                  f"latency caps reads at ~{b['latency_bound_read_tb_s']:.1f} TB/s")
            w("")
        w("   assumptions:")
        for a in entry["assumptions"]:
            w(f"     - {a}")
        w("")
    if report.get("launches"):
        w("== launches: the real launcher (qknorm_rope.cu under the SIMT emulation, dry run) on "
          "modelled devices, occupancy from ptxas registers")
        w(f"   {'device':<14} {'model':<10} {'stream':<16} {'batch':>5} {'rnd':>3} {'instance':<30} "
          f"{'blk/SM':>6} {'tok/grp':>7} {'ins/el':>6} {'B@wait':>6} {'KiB/SM':>6} {'avg':>6}")
        for ln in report["launches"]:
            model = ln.get("model", "-")
            if "instr_per_element" not in ln:
                w(f"   {ln['device']:<14} {model:<10} {ln['stream']:<16} {ln['batch']:>5} "
                  f"{ln['rounding']:>3} {str(ln['instance']):<30} (not in the SASS)")
                continue
            w(f"   {ln['device']:<14} {model:<10} {ln['stream']:<16} {ln['batch']:>5} {ln['rounding']:>3} "
              f"{ln['instance']:<30} {ln['blocks_per_sm']:>6} {ln['tokens_per_group']:>7.1f} "
              f"{fmt(ln['instr_per_element'], '.2f'):>6} {fmt(ln['bytes_outstanding_per_thread']):>6} "
              f"{ln['bytes_in_flight_per_sm'] / 1024:>6.1f} {ln['avg_bytes_in_flight_per_sm'] / 1024:>6.1f}")
        w("   ins/el = common-path SASS instructions per element over the whole kernel (loop per "
          "token + prologue/epilogue over tok/grp tokens);")
        w("   B@wait = global read bytes (q/k rows, cos/sin) per thread still outstanding past every wait "
          "of the steady-state token loop,")
        w("   read from the SASS scoreboards (the fewest at any wait); KiB/SM = B@wait x resident threads; "
          "avg = the average over the loop's waits")
        modes = sorted(LAUNCH_TARGETS[0]["instr_per_element"])
        w(f"   targets on {', '.join(f'sm_{a}' for a in TARGET_ARCHS)} devices: " + "; ".join(
            f">= {t['min_tokens']} tokens: >= {t['bytes_in_flight_per_sm'] // 1024} KiB, <= "
            + " / ".join(f"{t['instr_per_element'][m]:g}" for m in modes)
            + f" (rounding {' / '.join(str(m) for m in modes)})" for t in LAUNCH_TARGETS))
        w(f"   below {STEADY_TOKENS_PER_GROUP} tokens per group (the ring's fill only): the token loop's "
          f"instructions per element <= {THRESHOLDS} by rounding instead")
        w("")
    w(f"== structural checks (--check); instruction thresholds {THRESHOLDS} by rounding mode, "
      f"from {THRESHOLD_SOURCE}")
    by = collections.OrderedDict()
    for c in report["checks"]:
        by.setdefault((c["arch"], c["check"]), []).append(c)
    for (arch, name), cs in by.items():
        bad = [c for c in cs if not c["ok"]]
        w(f"   sm_{arch} {name:<22} {'ok' if not bad else 'FAIL'}  ({len(cs) - len(bad)}/{len(cs)} instances)")
        for c in bad[:MAX_FAILURES_LISTED]:
            w(f"      FAIL {c['instance']}: {c['detail']}")
        if len(bad) > MAX_FAILURES_LISTED:
            w(f"      ... and {len(bad) - MAX_FAILURES_LISTED} more (all in --json)")
        if name == "instr-per-element" and not bad:
            for c in cs:
                w(f"      {c['instance']}: {c['detail']}")
    return "\n".join(out)


def json_ready(report: dict) -> dict:
    return json.loads(json.dumps(report, default=str))
