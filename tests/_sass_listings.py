"""Synthetic ``cuobjdump -sass`` listings for the SASS reader's and the kernel report's tests: the
analysis runs on them without the CUDA tools, so it can be shown to fail."""

from __future__ import annotations


def sass_listing(lines, fn="_Z4fakev", arch=90):
    """cuobjdump -sass text for one function; instruction k sits at address 16*k."""
    body = "".join(f"        /*{16 * k:04x}*/                   {t} ;"
                   f"                                      /* 0x000000000000 */\n"
                   f"                                                                 /* 0x000fe2 */\n"
                   for k, t in enumerate(lines))
    return (f"\n\tcode for sm_{arch}\n\t\tFunction : {fn}\n"
            f'\t.headerflags\t@"EF_CUDA_SM{arch} EF_CUDA_VIRTUAL_SM(EF_CUDA_SM{arch})"\n' + body)


def loop_kernel(qk_load="LDG.E.EF.128", store="STG.E.128", pad=0, extra=()):
    """A fast-path-like kernel: a loop at 0x30 loading two 128-bit rows and a 32-bit cos value,
    a guarded MUFU, two 128-bit stores, and a back edge; `pad` FADDs inside the loop."""
    lines = [
        "LDC R1, c[0x0][0x28]",
        "LDG.E.128.CONSTANT R16, desc[UR8][R16.64]",
        "S2R R3, SR_TID.X",
        f"{qk_load} R20, desc[UR8][R2.64]",            # 0x30: loop head
        "LDG.E.EF.128 R24, desc[UR8][R4.64]",
        "LDG.E.CONSTANT R30, desc[UR8][R10.64]",
        "FMUL R8, R20, R20",                           # consumes the first load
        "@P1 BRA 0x90",
        "MUFU.RSQ R9, R8",                             # skipped by the branch above
        "NOP",
        "FFMA R10, R24, R9, R30",
    ]
    lines += ["FADD R11, R11, R10"] * pad + list(extra)
    lines += [f"{store} desc[UR8][R6.64], R20", f"{store} desc[UR8][R12.64], R24"]
    head = 0x30
    lines += [f"@!P0 BRA 0x{head:x}", "EXIT", f"BRA 0x{16 * (len(lines) + 2):x}"]
    return lines
