"""The SASS reader (qkrope.apps.kernel_report.sass) on synthetic listings (tests/_sass_listings.py): the
parser, the control flow (loops, the hot loop, the diverged-warp fallback, the common path) and
the loads outstanding at a token's first wait, and the parsers of ptxas and cuobjdump output.
No CUDA tool is needed for those; the scoreboard reader also proves itself on small kernels with
known answers compiled for sm_90 (nvcc and cuobjdump/nvdisasm, skipped without them);
tests/test_kernel_report.py runs the same reader on the compiled kernel."""
from __future__ import annotations

import subprocess

import pytest

from _sass_listings import KNOWN_ANSWER_CU, controlled_listing, loop_kernel, sass_listing
from qkrope.apps.kernel_report import sass
from qkrope.apps.kernel_report.sass import scoreboards


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


# ---- the scoreboard reader ---------------------------------------------------------------------------
def test_control_bits_are_decoded_from_the_high_word():
    rows = [("LDG.E.128 R4, desc[UR4][R2.64]", dict(wr=2)),
            ("STG.E.128 desc[UR4][R6.64], R4", dict(rd=0, wait=(2,), stall=4)),
            ("DEPBAR.LE SB0, 0x1", dict(stall=3))]
    ((_, instrs),) = sass.parse_sass(controlled_listing(rows)).items()
    c = [i.control for i in instrs]
    assert (c[0].write_sb, c[0].read_sb, c[0].waits_on()) == (2, None, [])
    assert (c[1].write_sb, c[1].read_sb, c[1].waits_on(), c[1].stall) == (None, 0, [2], 4)
    assert (c[2].write_sb, c[2].waits_on(), c[2].stall) == (None, [], 3)
    # synthetic listings without an encoding carry no control bits, and the reader says so
    plain = _instrs(loop_kernel())
    assert all(i.control is None for i in plain)
    with pytest.raises(ValueError, match="control bits"):
        scoreboards.scoreboard_waits(plain)


def test_a_wait_retires_everything_on_its_scoreboard():
    # the old kernel's schedule in small: the next token's row and this token's cos on one
    # scoreboard; the first use of cos waits for both, so nothing stays outstanding past it
    rows = [("LDG.E.EF.128 R20, desc[UR8][R2.64]", dict(wr=1)),        # row two tokens ahead
            ("LDG.E.128.CONSTANT R8, desc[UR8][R4.64]", dict(wr=1)),   # cos of this token
            ("FMUL R9, R8, R8", dict(wait=(1,))),
            ("STG.E.128 desc[UR8][R6.64], R20", dict()),
            ("@!P0 BRA 0x0", dict())]
    ((_, instrs),) = sass.parse_sass(controlled_listing(rows)).items()
    waits = scoreboards.scoreboard_waits(instrs)
    assert [(w["addr"], w["pending"], w["outstanding"]) for w in waits] == [(0x20, 32, 0)]
    assert waits[0]["retired"] == {"qk": 1, "cache": 1}
    # the same loads on two scoreboards, the store waiting for the row's: the row stays in flight
    # past the wait for cos
    rows[0] = ("LDG.E.EF.128 R20, desc[UR8][R2.64]", dict(wr=2))
    rows[3] = ("STG.E.128 desc[UR8][R6.64], R20", dict(wait=(2,)))
    ((_, instrs),) = sass.parse_sass(controlled_listing(rows)).items()
    waits = scoreboards.scoreboard_waits(instrs)
    assert [(w["addr"], w["pending"], w["outstanding"], w["retired"]) for w in waits] == [
        (0x20, 32, 16, {"cache": 1}), (0x30, 16, 0, {"qk": 1})]


def test_depbar_retires_the_oldest_groups_only():
    rows = [("LDGSTS.E.BYPASS.128 [R3], desc[UR6][R4.64]", dict(rd=2)),
            ("LDGSTS.E.BYPASS.128 [R3+0x10], desc[UR6][R6.64]", dict(rd=2)),
            ("LDGDEPBAR", dict(wr=0)),
            ("DEPBAR.LE SB0, 0x2", dict()),
            ("LDS.128 R8, [R3]", dict(wr=1)),
            ("STG.E.128 desc[UR8][R6.64], R8", dict(wait=(1,))),
            ("@!P0 BRA 0x0", dict())]
    ((_, instrs),) = sass.parse_sass(controlled_listing(rows)).items()
    waits = scoreboards.scoreboard_waits(instrs)
    # three groups of 32 B pending at DEPBAR.LE SB0, 2: the oldest retires, two stay in flight
    assert [(w["sass"], w["pending"], w["outstanding"]) for w in waits] == [
        ("DEPBAR.LE SB0, 0x2", 96, 64), ("STG.E.128 desc[UR8][R6.64], R8", 64, 64)]
    assert scoreboards.wait_summary(waits) == {"waits": 2, "min_outstanding": 64, "avg_outstanding": 64.0,
                                               "min_pending": 64, "avg_pending": 80.0}


@pytest.fixture(scope="module")
def known_answers(tmp_path_factory):
    """The known-answer kernels (tests/_sass_listings.py KNOWN_ANSWER_CU) compiled for sm_90:
    {function name: (instructions, hot loop)}."""
    try:
        tools = sass.Tools()
    except sass.ToolError as exc:
        pytest.skip(f"the known-answer kernels need the CUDA tools: {exc}")
    d = tmp_path_factory.mktemp("known_answers")
    (d / "ka.cu").write_text(KNOWN_ANSWER_CU)
    res = subprocess.run([tools.nvcc, "-std=c++17", "-O3", "-cubin", "-arch=sm_90", str(d / "ka.cu"),
                          "-o", str(d / "ka.cubin")], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    funcs = sass.parse_sass(tools.cuobjdump_run("-sass", str(d / "ka.cubin")))
    out = {}
    for (arch, name), instrs in funcs.items():
        assert arch == 90
        loop, _ = sass.find_hot_loop(instrs)
        assert loop is not None, name
        out[name] = (instrs, loop)
    return out


def _waits(known, name):
    instrs, loop = known[name]
    return scoreboards.scoreboard_waits(sass.loop_body(instrs, loop), sass.cold_addresses(instrs, loop))


@pytest.mark.parametrize("n", [1, 2, 4])
def test_known_answer_copy_kernel_with_n_loads_in_flight(known_answers, n):
    waits = _waits(known_answers, f"_Z5copyNILi{n}EEvPK5uint4PS0_i")
    # the k-th store waits for the k-th load: N - k + 1 loads pending, N - k past the wait
    assert [w["pending"] for w in waits] == [16 * (n - k) for k in range(n)]
    assert [w["outstanding"] for w in waits] == [16 * (n - k - 1) for k in range(n)]
    assert all(w["retired"] == {"qk": 1} for w in waits)


def test_known_answer_cp_async_double_buffer(known_answers):
    waits = _waits(known_answers, "_Z13cpAsyncDoublePK5uint4PS_i")
    depbars = [w for w in waits if w["sass"].startswith("DEPBAR")]
    # wait_group 1 after committing the next tile: two 16-byte groups pending, one stays in flight,
    # at every tile of the (unrolled) loop; the shared-memory loads that follow leave it in flight
    assert depbars and len(depbars) == len(waits) // 2
    assert all((w["pending"], w["outstanding"], w["retired"]) == (32, 16, {"async": 1}) for w in depbars)
    assert scoreboards.wait_summary(waits)["min_outstanding"] == 16
