"""The SASS reader (qkrope.runtime.sass) on synthetic listings (tests/_sass_listings.py): the
parser, the control flow (loops, the hot loop, the diverged-warp fallback, the common path) and
the loads outstanding at a token's first wait, and the parsers of ptxas and cuobjdump output.
No CUDA tool is needed; tests/test_kernel_report.py runs the same reader on the compiled kernel."""
from __future__ import annotations

from _sass_listings import loop_kernel, sass_listing
from qkrope.runtime import sass


def _instrs(lines):
    ((_, instrs),) = sass.parse_sass(sass_listing(lines)).items()
    return instrs


def test_parse_sass_and_loop_finder():
    lines = loop_kernel()
    funcs = sass.parse_sass(sass_listing(lines))
    ((arch, fn), instrs), = funcs.items()
    assert (arch, fn) == (90, "_Z4fakev") and len(instrs) == len(lines)
    assert instrs[7].pred == "@P1" and instrs[7].branch_target == 0x90
    assert instrs[3].width == 128 and not instrs[3].is_constant and instrs[3].qualifiers == ["E", "EF"]
    assert instrs[5].width == 32 and instrs[5].is_constant
    assert instrs[3].dest_registers() == {20, 21, 22, 23}
    assert sass.find_loops(instrs) == [(0x30, 0xd0)]  # the trap `BRA self` after EXIT is no loop
    assert sass.find_hot_loop(instrs) == ((0x30, 0xd0), 1)


def test_innermost_loop_with_the_stores_is_the_hot_loop():
    lines = [
        "S2R R3, SR_TID.X",
        "IADD3 R4, R4, 0x1, RZ",                        # 0x10: outer head
        "LDG.E.128 R20, desc[UR8][R2.64]",              # 0x20: inner head (with stores)
        "STG.E.128 desc[UR8][R6.64], R20",
        "@P0 BRA 0x20",                                 # 0x40: inner back edge
        "FADD R5, R5, R5",                              # 0x50: a store-free loop
        "@P1 BRA 0x50",
        "@P2 BRA 0x10",                                 # 0x70: outer back edge
        "EXIT",
    ]
    instrs = _instrs(lines)
    assert sass.find_loops(instrs) == [(0x10, 0x70), (0x20, 0x40), (0x50, 0x60)]
    assert sass.find_hot_loop(instrs)[0] == (0x20, 0x40)


def test_diverged_warp_fallback_is_not_a_loop():
    # ptxas places the diverged-warp path of a shuffle out of line (BRA.DIV) and jumps back
    # into the loop from there: that backward jump must not define a loop
    lines = [
        "S2R R3, SR_TID.X",
        "LDG.E.128 R20, desc[UR8][R2.64]",              # 0x10: loop head
        "BRA.DIV UR4, 0x80",
        "SHFL.BFLY PT, R9, R20, 0x1, 0x1f",
        "FADD R20, R20, R9",                            # 0x40: rejoin point
        "STG.E.128 desc[UR8][R6.64], R20",
        "@!P0 BRA 0x10",                                # 0x60: back edge
        "EXIT",
        "WARPSYNC.ALL",                                 # 0x80: fallback
        "BRA 0x40",                                     # 0x90: jumps back into the loop
    ]
    instrs = _instrs(lines)
    assert sass.find_loops(instrs) == [(0x10, 0x60)]
    lp = sass.analyse_loop(instrs, 2)
    assert lp["longest_path"] == 6                    # BRA.DIV counted, not taken


def test_first_stall_counts_the_loads_still_outstanding_at_each_tokens_first_wait():
    # the synthetic loop issues both rows, then consumes the first: 2 outstanding at the wait
    instrs = _instrs(loop_kernel())
    body = sass.loop_body(instrs, sass.find_hot_loop(instrs)[0])
    assert sass.first_stall_loads(body) == [2]
    # the next row's load issued after the first use (the old kernel's schedule): 1 at the wait
    late = loop_kernel()
    late.insert(7, late.pop(4))          # LDG.E.EF.128 R24 moved after FMUL R8, R20, R20
    instrs = _instrs(late)
    body = sass.loop_body(instrs, sass.find_hot_loop(instrs)[0])
    assert sass.first_stall_loads(body) == [1]


def test_loads_at_first_wait_is_the_fewest_at_any_wait():
    assert sass.loads_at_first_wait({"first_stall_loads": [6, 4, 5],
                                     "in_flight": {"max_qk_loads_128": 9}}) == 4
    # no wait found: the loop's maximum outstanding
    assert sass.loads_at_first_wait({"first_stall_loads": [], "in_flight": {"max_qk_loads_128": 9}}) == 9


def test_common_path_skips_slow_path_calls_and_takes_guarded_blocks():
    # a CALL block inside the loop (the slow path's argument set-up + CALL + return branch) is
    # off the common path; the guarded MUFU is on it; prologue 3, epilogue 1 (the EXIT)
    call = ["@!P2 BRA 0xd0", "MOV R4, R8", "CALL.REL.NOINC 0x200", "BRA 0xd0"]
    lines = loop_kernel(extra=())
    lines[9:9] = call                    # after the MUFU, before the NOP
    instrs = _instrs(lines)
    loop = sass.find_hot_loop(instrs)[0]
    counts = sass.common_path_counts(instrs, loop)
    body = [i for i in instrs if loop[0] <= i.addr <= loop[1] and not i.is_nop]
    assert counts["prologue"] == 3 and counts["epilogue"] == 1
    assert counts["cold_in_loop"] == 3                  # MOV, CALL, BRA back
    assert counts["iteration"] == len(body) - 3


def test_tool_output_parsers():
    ptxas = sass.parse_ptxas(
        "ptxas info    : Compiling entry function '_Z1kv' for 'sm_90'\n"
        "ptxas info    : Function properties for _Z1kv\n"
        "    8 bytes stack frame, 4 bytes spill stores, 12 bytes spill loads\n"
        "ptxas info    : Used 80 registers, used 0 barriers, 16384 bytes smem, 8 bytes cumulative stack size\n")
    assert ptxas["_Z1kv"] == {"entry": True, "stack": 8, "spill_stores": 4, "spill_loads": 12, "regs": 80,
                              "smem": 16384, "barriers": 0}
    ru = sass.parse_res_usage(" Function _Z1kv:\n  REG:80 STACK:8 SHARED:17408 LOCAL:0 CONSTANT[0]:624\n")
    assert ru["_Z1kv"] == {"regs": 80, "stack": 8, "shared": 17408, "local": 0}
    elf = (".nv.info._Z1kv\n\t<0x10>\n\tAttribute:\tEIATTR_MAX_THREADS\n\tFormat:\tEIFMT_SVAL\n"
           "\tValue:\t0x100 0x1 0x1 \n")
    assert sass.parse_max_threads(elf) == {"_Z1kv": 256}
