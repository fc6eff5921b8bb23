"""The kernel instances of a compiled binary: compile the kernel (nvcc -cubin -Xptxas -v), read
each instance's SASS and resource figures, name it from its template arguments (the
``// kernel-report:`` lines of the source give the parameter names), pick the reference
instances (the default family's launch shape) and their thresholds, and analyse each into a
JSON-ready report entry."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

from qkrope.runtime import toolchain

from .assumptions import (HARDWARE, THRESHOLDS, assumptions, occupancy, problem_bounds,
                          reference_match)
from .sass import (LOCAL_OPS, STORE_POLICY_QUALIFIERS, Instr, ToolError, Tools,
                   analyse_loop, outstanding_at_waits, parse_max_threads, parse_ptxas,
                   parse_res_usage, parse_sass)

SOURCE = toolchain.REPO_ROOT / "plugins" / "kernel" / "qknorm_rope.cu"
BUILD_DIR = toolchain.BUILD_ROOT / "kernel_report"
DEFAULT_ARCHS = (90, 100)

# Kernel names (the demangled function template names) and their template parameter names.
# The names are read from a machine-readable line in the .cu when there is one, e.g.
#   // kernel-report: qkNormRopeFastKernel<T, HEAD_DIM, INTERLEAVED, ROWS, ROUNDING, FULL_ROTARY>
# and otherwise from FALLBACK_PARAMS (the kernel before the rewrite, where rounding is a runtime
# argument). PARAM_ROLES says which parameter name means what.
FAST_KERNEL = "qkNormRopeFastKernel"
GENERAL_KERNEL = "qkNormRopeGeneralKernel"
# norm_scope 1: the fast path's row kernel (a block per token row; analysed like the fast path)
# and the general path's
ROW_KERNEL = "qkNormRopeRowKernel"
GENERAL_ROW_KERNEL = "qkNormRopeGeneralRowKernel"
# kernel -> (kind, label prefix)
KERNEL_KINDS = {FAST_KERNEL: ("fast", "Fast"), GENERAL_KERNEL: ("general", "General"),
                ROW_KERNEL: ("row", "Row"), GENERAL_ROW_KERNEL: ("general-row", "GeneralRow")}
KERNEL_NAMESPACE = "qkrope::(anonymous namespace)::"
FALLBACK_PARAMS = {
    FAST_KERNEL: ("T", "HEAD_DIM", "INTERLEAVED", "UNROLL"),
    GENERAL_KERNEL: ("T",),
    ROW_KERNEL: ("T", "HEAD_DIM", "INTERLEAVED", "ROWS", "ROUNDING", "FULL_ROTARY"),
    GENERAL_ROW_KERNEL: ("T", "PAIRS", "ALIGNED"),
}
KERNEL_REPORT_RE = re.compile(r"//\s*kernel-report:\s*(\w+)\s*<([^>]*)>")
PARAM_ROLES = {
    "type": ("T",),
    "head_dim": ("HEAD_DIM",),
    "interleaved": ("INTERLEAVED",),
    "rounding": ("ROUNDING", "ROUNDING_MODE"),
    "full_rotary": ("FULL_ROTARY",),
    "rows": ("ROWS",),
}
# The reference instances (assumptions.reference_match: the default family's launches): every
# fast-path instance whose parameters with these roles have these values (a tuple: any of them;
# a role the kernel has no parameter for is not compared). Every rows-per-unit instance of that
# shape is one the launcher may pick (plan_launches says which it does pick for each launch and
# modelled device).
REFERENCE_MATCH = reference_match()
ELEMENT_BYTES = {"Fp32": 4, "Fp16": 2, "Bf16": 2}


def compile_cubins(archs: list[int], nvcc: str, source: Path = SOURCE,
                   out_dir: Path = BUILD_DIR) -> dict[int, tuple[Path, str]]:
    """nvcc -cubin -Xptxas -v for each arch (in parallel); {arch: (cubin, ptxas log)}."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    procs = {}
    for arch in archs:
        cubin = out_dir / f"qknorm_rope_sm{arch}.cubin"
        log = out_dir / f"qknorm_rope_sm{arch}.ptxas.log"
        cmd = [nvcc, "-std=c++17", "-O3", "-cubin", f"-arch=sm_{arch}", "-Xptxas", "-v",
               "-I", str(Path(source).parent), str(source), "-o", str(cubin)]
        fh = open(log, "w")  # noqa: SIM115 - closed below
        procs[arch] = (subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, text=True), fh,
                       cubin, log, cmd)
    result = {}
    errors = []
    for arch, (proc, fh, cubin, log, cmd) in procs.items():
        proc.wait()
        fh.close()
        text = log.read_text()
        if proc.returncode != 0:
            errors.append(f"sm_{arch}: {' '.join(cmd)} failed (rc={proc.returncode}); last lines "
                          f"of {log}:\n" + "\n".join(text.splitlines()[-15:]))
        result[arch] = (cubin, text)
    if errors:
        raise ToolError("kernel build failed:\n" + "\n".join(errors))
    return result


def read_param_names(source_text: str | None) -> tuple[dict[str, tuple[str, ...]], dict[str, str]]:
    """Template parameter names per kernel: the `// kernel-report:` lines of the source where
    present, else FALLBACK_PARAMS. Returns (names, origin per kernel)."""
    names = dict(FALLBACK_PARAMS)
    origin = {k: "fallback (no kernel-report line)" for k in FALLBACK_PARAMS}
    for m in KERNEL_REPORT_RE.finditer(source_text or ""):
        names[m.group(1)] = tuple(p.strip() for p in m.group(2).split(",") if p.strip())
        origin[m.group(1)] = "kernel-report line in the source"
    return names, origin


def template_args(demangled: str, kernel: str) -> list[str] | None:
    """The template argument list after `kernel<` (balanced), split at top-level commas, each
    normalised: namespaces dropped (`qkrope::math::Bf16` -> `Bf16`), casts dropped
    (`(qkrope::math::Rounding)1` -> `1`)."""
    start = demangled.find(kernel + "<")
    if start < 0:
        return None
    i = start + len(kernel) + 1
    depth, cur, args = 1, "", []
    while i < len(demangled) and depth:
        c = demangled[i]
        if c in "<([":
            depth += 1
        elif c in ">)]":
            depth -= 1
        if depth == 0:
            break
        if c == "," and depth == 1:
            args.append(cur)
            cur = ""
        else:
            cur += c
        i += 1
    args.append(cur)
    out = []
    for a in args:
        a = a.strip()
        a = re.sub(r"^\([^()]*\)\s*", "", a)          # (Enum)1 -> 1
        a = a.split("::")[-1] if re.fullmatch(r"[\w:]+", a) else a
        out.append(a)
    return out


def role_values(params: dict[str, str]) -> dict[str, str]:
    out = {}
    for role, names in PARAM_ROLES.items():
        for n in names:
            if n in params:
                out[role] = params[n]
    return out


def is_reference(kind: str, roles: dict[str, str]) -> bool:
    """A fast-path instance whose parameters match REFERENCE_MATCH (type, head_dim and interleaved
    must be template parameters; full_rotary is compared only where the kernel has it)."""
    if kind != "fast" or not all(r in roles for r in ("type", "head_dim", "interleaved")):
        return False
    def ok(have: str, want) -> bool:
        wanted = (want,) if isinstance(want, str) else want
        return have.lower() in (w.lower() for w in wanted)
    return all(ok(roles[r], v) for r, v in REFERENCE_MATCH.items() if r in roles)


def rounding_value(v: str) -> int | None:
    v = v.strip().lower()
    if v in ("true", "false"):
        return int(v == "true")
    try:
        return int(v.rstrip("u"), 0)
    except ValueError:
        return None


def analyse_function(instrs: list[Instr], demangled: str, arch: int, *, mangled: str = "",
                     ptxas: dict | None = None, res_usage: dict | None = None,
                     max_threads: int | None = None,
                     param_names: dict[str, tuple[str, ...]] | None = None) -> dict:
    """One kernel instance: its SASS, demangled name and resource figures -> the report entry
    (a JSON-ready dict). `param_names_mismatch` is set when the template parameter names did
    not fit the instance's argument count."""
    names = param_names if param_names is not None else dict(FALLBACK_PARAMS)
    dn = demangled
    kernel = _kernel_of(dn)
    kind = KERNEL_KINDS[kernel][0] if kernel else "other"
    args = template_args(dn, kernel) if kernel else None
    pnames = names.get(kernel, ()) if kernel else ()
    mismatch = False
    if args is not None and len(args) != len(pnames):
        # e.g. --cubin of an older build against a newer source: the names do not apply
        fb = FALLBACK_PARAMS.get(kernel, ())
        pnames = fb if len(fb) == len(args) else ()
        mismatch = True
    params = {}
    if args is not None:
        for k, a in enumerate(args):
            params[pnames[k] if k < len(pnames) else f"ARG{k}"] = a
    roles = role_values(params)
    elem_type = roles.get("type", args[0] if args else "")
    elem_bytes = ELEMENT_BYTES.get(elem_type, 0)
    hw = HARDWARE.get(arch, HARDWARE[90])

    px = ptxas or {}
    ru = res_usage or {}
    regs = px.get("regs", ru.get("regs", 0))
    if "smem" in px:
        smem = px["smem"]
    else:
        shared = ru.get("shared", 0)
        smem = shared - hw["smem_reserved_per_block"] if shared >= hw["smem_reserved_per_block"] else shared
    threads = max_threads
    threads_src = "__launch_bounds__ (EIATTR_MAX_THREADS)"
    if not threads:
        threads, threads_src = 256, "assumed 256 (no __launch_bounds__ in the ELF)"
    occ = occupancy(regs, smem, threads, hw)
    local_ops = [i.text for i in instrs if i.base in LOCAL_OPS]
    store_policies = sorted({q for i in instrs if i.is_global_store for q in i.qualifiers
                             if q in STORE_POLICY_QUALIFIERS})
    loop = analyse_loop(instrs, elem_bytes)

    short = KERNEL_KINDS[kernel][1] if kernel else dn.split("(")[0]
    label = f"{short}<{','.join(args)}>" if args is not None else short
    reference = is_reference(kind, roles)
    rounding = threshold = threshold_note = None
    if reference:
        if "rounding" in roles:
            rounding = rounding_value(roles["rounding"])
            threshold = THRESHOLDS.get(rounding)
            threshold_note = f"rounding={rounding} is a template argument"
        else:
            threshold = min(THRESHOLDS.values())
            threshold_note = ("rounding is a runtime argument: the hot loop holds the rounding=0 "
                              "and rounding=1 paths combined, checked against the stricter "
                              f"rounding=0 threshold ({threshold})")
    inst = {
        "arch": arch, "mangled": mangled, "demangled": dn, "kind": kind, "label": label,
        "template_params": params, "param_names_mismatch": mismatch, "roles": roles,
        "reference": reference,
        "rounding": rounding, "threshold": threshold, "threshold_note": threshold_note,
        "elem_bytes": elem_bytes,
        "regs": regs, "spill_stores": px.get("spill_stores"), "spill_loads": px.get("spill_loads"),
        "stack": px.get("stack", ru.get("stack")), "local": ru.get("local"), "smem": smem,
        "threads_per_block": threads, "threads_source": threads_src,
        "occupancy": occ, "local_memory_sass": local_ops, "store_policies": store_policies,
        "sass_instructions": sum(1 for i in instrs if not i.is_nop),
        "hot_loop": loop,
    }
    if reference and loop.get("found"):
        inst["bounds"] = problem_bounds(loop.get("instr_per_element"), outstanding_at_waits(loop)[0] or 0,
                                     occ["threads_per_sm"], hw)
    return inst


def analyse_cubin(cubin: Path, tools: Tools, *, ptxas_log: str | None = None,
                  source_text: str | None = None, archs: list[int] | None = None) -> dict:
    """All instances of one cubin (or fat binary) -> {sm: {"instances": [...], ...}}."""
    functions = parse_sass(tools.cuobjdump_run("-sass", str(cubin)))
    if not functions:
        raise ToolError(f"no SASS functions in {cubin} (cuobjdump -sass printed nothing usable)")
    res_usage = parse_res_usage(tools.cuobjdump_run("-res-usage", str(cubin)))
    try:
        max_threads = parse_max_threads(tools.cuobjdump_run("-elf", str(cubin)))
    except ToolError:
        max_threads = {}
    ptxas = parse_ptxas(ptxas_log) if ptxas_log else {}
    demangled = tools.demangle(sorted({name for _, name in functions}))
    names, origin = read_param_names(source_text)

    result: dict = {}
    for (arch, mangled), instrs in sorted(functions.items()):
        if archs and arch not in archs:
            continue
        inst = analyse_function(instrs, demangled.get(mangled, mangled), arch, mangled=mangled,
                                ptxas=ptxas.get(mangled), res_usage=res_usage.get(mangled),
                                max_threads=max_threads.get(mangled), param_names=names)
        entry = result.setdefault(arch, {
            "instances": [], "param_names": {k: list(v) for k, v in names.items()},
            "param_origin": dict(origin), "ptxas": bool(ptxas), "assumptions": assumptions(arch),
            "hardware": HARDWARE.get(arch, HARDWARE[90])})
        entry["instances"].append(inst)
        if inst["param_names_mismatch"]:
            kernel = _kernel_of(inst["demangled"])
            note = " - does not fit this binary's template arguments: fallback names or ARGn used"
            if not entry["param_origin"].get(kernel, "").endswith(note):
                entry["param_origin"][kernel] = entry["param_origin"].get(kernel, "") + note
    kind_order = {"fast": 0, "general": 1, "row": 2, "general-row": 3, "other": 4}
    for entry in result.values():
        entry["instances"].sort(key=lambda x: (kind_order[x["kind"]], not x["reference"], _natural(x["label"])))
    return result


def _kernel_of(demangled: str) -> str | None:
    """Which of KERNEL_KINDS a demangled name instantiates (None: another function)."""
    for kernel in KERNEL_KINDS:
        if kernel + "<" in demangled:
            return kernel
    return None


def label_of(demangled: str) -> str | None:
    kind = _kernel_of(demangled)
    if kind is None:
        return None
    args = template_args(demangled, kind)
    short = KERNEL_KINDS[kind][1]
    return f"{short}<{','.join(args)}>" if args is not None else None


def _natural(label: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", label)]
