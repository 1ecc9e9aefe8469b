"""Registers, spills and shared memory of our Triton kernels, compiled for sm_90 without a GPU.

    python tools/kernel_resources.py            # the GDN forward and backward kernels, bench shape
    python tools/kernel_resources.py --only "bwd _prep" --warps 8 --gate 2   # a sweep point

Compiles each kernel (Triton's own ptxas) for an H100/H200 target on any machine
and reads the cubin's resource usage with cuobjdump: registers per thread, stack
bytes (spills), shared memory, and how many layout conversions and shared-memory
buffers the Triton GPU IR holds, and its asynchronous copies: the loads Triton's
pipeliner issues ahead of use (a loop with a branch in it gets none, which is why the
sequential kernels launch a branch-free matrix part first; docs/gdn.md). A tuning loop that costs no device time: a kernel
at 255 registers with a stack frame is spilling, which the device profile then
confirms or not. The loop column counts what one pass of the kernel's longest loop
issues, from its SASS (`loop_counts`). The last column, an md5 of the PTX's code (`code_of`: debug info
stripped), shows whether a refactor compiles to the same code: if it does, it needs no
device run. It measures no time. It compiles with the Triton it imports: for the
device's (3.6.0), `pip install --target /tmp/t36 triton==3.6.0` and run it with
`PYTHONPATH=/tmp/t36`.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)   # a real compile, not the interpreter

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402,F401
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gdn.chunk_bwd as cb  # noqa: E402
import gdn.chunk_fwd as cf  # noqa: E402
import gdn.fwd_prep as fp  # noqa: E402
import gdn.fwd_state as fs  # noqa: E402
from gdn import common  # noqa: E402
from gdn.common import forward_precision  # noqa: E402
from gdn.config import DEFAULT  # noqa: E402

CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def resources(fn, signature: dict, constexprs: dict, num_warps: int, num_stages: int = 1,
              aligned=(), maxnreg=None) -> dict:
    """Compile `fn` for sm_90 and return its resource usage.  `aligned`: the arguments a launch
    would specialize as divisible by 16 (pointers from torch, integers that are multiples of 16);
    without the hint every offset built from a runtime integer is assumed unaligned, loads are
    not vectorized and the stack is far larger than the launch's (the backward's _grads_p at the
    bench shape: 1376 bytes without)."""
    sig = dict(signature, **{n: "constexpr" for n in constexprs})
    attrs = {(fn.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": num_warps, "num_stages": num_stages,
                                **({"maxnreg": maxnreg} if maxnreg else {})})
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    usage = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True).stdout
    sass = subprocess.run([CUOBJDUMP, "-sass", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)

    def field(name):
        m = re.search(rf"{name}:(\d+)", usage)
        return int(m.group(1)) if m else -1
    ttgir = k.asm["ttgir"]
    return {"registers": field("REG"), "stack": field("STACK"), "shared": k.metadata.shared,
            "ptx": hashlib.md5(code_of(k.asm["ptx"]).encode()).hexdigest()[:12],
            "convert_layout": ttgir.count("ttg.convert_layout"), "local_alloc": ttgir.count("ttg.local_alloc"),
            "async_copies": ttgir.count("async_copy_global_to_local") + ttgir.count("async_tma_copy_global_to_local"),
            "unwritten_uniform": len(unwritten_uniform(sass)), **loop_counts(sass)}


def unwritten_uniform(sass: str) -> list:
    """The uniform-register additions (UIADD3) in the SASS, in program order, that read a
    uniform register no instruction before them wrote: ptxas 12.8.93 (Triton 3.6's for sm_90)
    builds wgmma shared-memory descriptors so in the state pass's matrix part with BV 32 at an
    odd K or one stage (`UIADD3 UR10, UP0, UR10, 0x40`; the PTX adds to the right base), and the product
    then reads shared memory at a stale address: the H200's G03 fault (compute-sanitizer:
    "Invalid __shared__ read of size 1024 bytes"; docs/findings.md).  Program order is
    not every path, so a register written only in a loop's later part and read at its top
    would be listed too; ptxas writes the descriptors before the loop, where none was."""
    written, found = set(), []
    for ln in sass.splitlines():
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)\s+([^;]*);", ln)
        if not m:
            continue
        op, args = m.group(2), [x.strip() for x in m.group(3).split(",")]
        dst = re.findall(r"\bUR(\d+)\b", args[0]) if args else []
        if op.startswith("UIADD3"):
            srcs = [r for x in args[1:] for r in re.findall(r"\bUR(\d+)\b", x)]
            if any(r not in written for r in srcs):
                found.append(f"{m.group(1)}: {op} {m.group(3).strip()}")
        written.update(dst)
        if ".64" in op or ".WIDE" in op:   # a 64-bit write names its low register only
            written.update(str(int(r) + 1) for r in dst)
    return found


def loop_counts(sass: str) -> dict:
    """What one pass of the kernel's longest loop issues, from its SASS (the instructions from
    the target of the longest backward branch to the branch): instructions, barriers
    (BAR.SYNC: every warp of the program waits there), shuffles and global loads not issued
    as asynchronous copies (LDG).  A sequential kernel's loop is its serial chain: the scalar
    gate's scans and sums show there.  Zeros where no loop."""
    code = [ln for ln in sass.splitlines() if re.match(r"\s*/\*[0-9a-f]{4,}\*/\s+\S", ln)]
    addr = [int(re.match(r"\s*/\*([0-9a-f]+)\*/", ln).group(1), 16) for ln in code]
    body = []
    for i, ln in enumerate(code):
        m = re.search(r"BRA (?:`\()?0x([0-9a-f]+)", ln)
        if m and int(m.group(1), 16) < addr[i]:
            start = addr.index(int(m.group(1), 16)) if int(m.group(1), 16) in addr else i
            if i + 1 - start > len(body):
                body = code[start:i + 1]
    return {"loop_instructions": len(body), "loop_barriers": sum("BAR.SYNC" in ln for ln in body),
            "loop_shuffles": sum("SHFL" in ln for ln in body), "loop_ldg": sum(" LDG." in ln for ln in body)}


def code_of(ptx: str) -> str:
    """The PTX's code alone: without the debug sections, `.loc` lines, comments, the labels
    that mark inlined calls' debug ranges (`$L__tmpN`), file names and parameter numbers.  Two
    sources that compile to the same code give the same text: a helper function moved out of
    a kernel changes only the debug labels, which a comparison of raw PTX would count as a
    change of code."""
    ptx = ptx.split(".section\t.debug")[0].split(".section .debug")[0]
    for pattern, repl in ((r"^\s*\.loc.*$", ""), (r"^\s*//.*$", ""), (r"^\$L__tmp\d+:\s*$", ""),
                          (r"\.file.*", ""), (r"_param_\d+", "_param_N"), (r"\n\s*\n+", "\n")):
        ptx = re.sub(pattern, repl, ptx, flags=re.M)
    return ptx


def _ptrs(names, dtype):
    return {n: dtype for n in names}


def gdn_kernels(K=128, V=128, gate=1, delta=True, fp32=False, state_bv=64):
    """(label, fn, signature, constexprs, warps, stages, aligned, maxnreg) of the GDN kernels at bf16
    (fp32: at fp32 inputs); the state pass's matrix part at V tiles of ``state_bv``."""
    X, DT = ("*fp32", tl.float32) if fp32 else ("*bf16", tl.bfloat16)
    BT = 16 if gate == 2 else 64
    prec = forward_precision(torch.float32 if fp32 else torch.bfloat16)
    common = dict(H=16, K=K, V=V, BK=max(16, triton.next_power_of_2(K)), BT=BT, GATE=gate,
                  IS_VARLEN=False, PREC=prec, BIG=65536.0)
    scal = {"T": "i32", "NT": "i32"}
    state_sig = {**_ptrs(["q", "k", "v", "beta", "w", "u", "hs", "vn", "o"], X),
                 **_ptrs(["g", "gc", "gcl", "h0", "hT", "sstop"], "*fp32"),
                 **_ptrs(["gflag", "flag", "stop", "cu", "choff", "hexp"], "*i32"), "xflag": "*i8",
                 "scale": "fp32", **scal, "OCC": "i32"}
    out_sig = {**_ptrs(["q", "k", "v", "beta", "hs", "vn", "o"], X), **_ptrs(["g", "gc", "gcl"], "*fp32"),
               **_ptrs(["xflag", "oflag"], "*i8"), **_ptrs(["cb_ptr", "ce_ptr", "hexp"], "*i32"),
               "scale": "fp32", **scal, "NC": "i32"}
    dt = dict(DELTA=delta)
    lowp = gate != 2 and not fp32   # bf16 inputs: the prep's exact bf16 splits (gdn.fwd_prep)
    t32 = fp.t_dtype(lowp, BT) == torch.float32   # T's dtype (prep_t_bf16)
    inv_sig = {**_ptrs(["k", "beta"], X), **_ptrs(["gc", "gcl"], "*fp32"), "tm": "*fp32" if t32 else "*bf16",
               **_ptrs(["flag", "cb_ptr", "ce_ptr"], "*i32"), **scal}
    wu_sig = {**_ptrs(["k", "v", "beta", "w", "u"], X), **_ptrs(["gc", "gcl"], "*fp32"),
              "tm": "*fp32" if t32 else "*bf16", **_ptrs(["flag", "cb_ptr", "ce_ptr"], "*i32"), **scal}
    split = {n: common[n] for n in ("H", "K", "BK", "BT", "GATE", "IS_VARLEN", "PREC", "BIG")}
    out = cf.out_launch(common["BK"], V, gate, torch.float32 if fp32 else torch.bfloat16)
    caps = {"fwd _prep_inv_kernel": fp._cap(DEFAULT.prep_inv_maxnreg, False, lowp).get("maxnreg"),
            "fwd _prep_wu_kernel": fp._cap(DEFAULT.prep_wu_maxnreg, False, lowp).get("maxnreg"),
            "fwd _out_kernel (matrix part)": out.get("maxnreg"), "fwd _out_kernel (exact part)": out.get("maxnreg")}
    for label, fn, sig, const, warps, stages in (
            ("fwd _prep_inv_kernel", fp._prep_inv_kernel, inv_sig,
             dict(split, LOWP=lowp, INTERP=False, W=32 * DEFAULT.prep_inv_warps,
                  MB=fp.merge_mode(lowp, False)),
             DEFAULT.prep_inv_warps, 1),
            ("fwd _prep_wu_kernel", fp._prep_wu_kernel, wu_sig,
             dict(split, V=V, BV=64, LOWP=lowp, INTERP=False, TLO=t32),
             DEFAULT.prep_wu_warps,
             DEFAULT.prep_wu_stages),
            ("fwd _state_kernel (matrix part)", fs._state_kernel, state_sig,
             dict(common, BV=state_bv, HAS_H0=False, STORE_HT=True, SBIG=1e30, PART=0, DT=DT, **dt),
             4, 2),
            ("fwd _state_kernel (resume part)", fs._state_kernel, state_sig,
             dict(common, BV=DEFAULT.state_resume_bv, HAS_H0=False, STORE_HT=True, SBIG=1e30, PART=1, DT=DT, **dt),
             4, 3),
            ("fwd _out_kernel (matrix part)", cf._out_kernel, out_sig,
             dict(common, BV=out["BV"], DT=DT, PART=0, BKS=out["BKS"], G=DEFAULT.out_chunks, **dt),
             out["num_warps"], out.get("num_stages", 3)),
            ("fwd _out_kernel (exact part)", cf._out_kernel, out_sig,
             dict(common, BV=out["BV"], DT=DT, PART=1, BKS=out["BKS"], G=DEFAULT.out_chunks, **dt),
             out["num_warps"], out.get("num_stages", 3))):
        # as a launch at B8 T4096 (NT 64, NC 512, OCC 128) specializes: pointers, T, NT, NC, OCC
        aligned = tuple(a for a, t in sig.items() if t.startswith("*") or a in ("T", "NT", "OCC", "NC"))
        yield (label, fn, sig, const, warps, stages, aligned, caps.get(label))


# pointer arguments of the backward kernels that are not bf16 in a bf16 run (the rest are
# inputs, gradients or bf16 hand-off tensors: gdn.common.handoff_dtype; the chunk-end state
# gradients dhs are fp32)
_BWD_FP32 = {"g", "dg", "h0", "dht", "dh0", "dkp", "dgp", "sstop", "HD", "dhs"}
_BWD_I32 = {"flag", "hflag", "dflag", "cu", "tab", "coff", "stop", "hexp", "dexp"}


def gdn_bwd_kernels(K=128, V=128, gate=1, delta=True, fp32=False, given_t=False, saved=False):
    """(label, fn, signature, constexprs, warps, stages, aligned, maxnreg) of the GDN backward kernels
    as gdn.chunk_bwd.chunk_gdn_bwd launches them at bf16 (its tiles and gdn.config.DEFAULT at V), with an
    initial state and a final-state gradient (given_t: `_prep` on the forward's T, as the op
    launches it, at its "prep_given_warps"; saved: W and U taken from the forward, as the op
    does with save_states); `aligned` as a launch at T=4096 H=16 (B8 T4096,
    the bench shape) specializes: every pointer, and T, H, K, V where multiples of 16."""
    C = 16 if gate == 2 else 64
    F32, DT = cb._dot_mode(torch.float32 if fp32 else torch.bfloat16)
    tile = cb.tiles(K, V)
    launch = DEFAULT.at_v(V)
    seq = launch.bwd_seq_warps
    prep = cb.prep_launch(launch, given_t, C)
    consts = dict(C=C, BK=tile["BK"], GATE=gate, DELTA=delta, IS_VARLEN=False, F32=F32, DT=DT,
                  GLIM=common.VECTOR_DECAY_MAX, PREC="ieee" if F32 else "tf32", BIG=common.BIG, SBIG=common.SBIG,
                  HAS_H0=True, HAS_DHT=True, GIVEN_T=given_t, PART=0, IW=prep["IW"],
                  SAVED=saved, FWD_FLAGS=saved)
    bvd = cb.dstates_tile(tile["BK"], V, 8 * 16, 132)   # B8 H16 on the H200's 132 SMs
    fp32_args = _BWD_FP32 | {"Tm"}   # T is fp32 (_prep's inverse's scratch)
    # stages 3 is Triton's default: the launcher sets none for _exact
    grads_stages = cb.stages(launch, "bwd_grads_stages", F32)
    for fn, bv, warps, stages, extra in (
            (cb._prep, tile["BV"], prep["num_warps"], cb.stages(launch, "bwd_prep_stages", F32), {}),
            # the sequential kernels' matrix parts (PART 0) and resume parts (PART 1)
            *((cb._states, tile["BV"], seq, cb.stages(launch, "bwd_seq_stages", F32, tile["BK"]), {"PART": part})
              for part in (0, 1)),
            *((cb._dstates, bvd, launch.bwd_dstates_warps,
               cb.stages(launch, "bwd_dstates_stages", F32, tile["BK"]), {"PART": part}) for part in (0, 1)),
            # the gradients: _grads_p (and _grads_wy with delta)
            (cb._grads_p, tile["grads_BV"], launch.bwd_grads_p_warps, grads_stages,
             {"BKS": tile["grads_BKS"]}),
            (cb._exact, tile["exact_BV"], seq, 3, {"G": launch.bwd_exact_chunks}),
            *(((cb._grads_wy, tile["grads_BV"], launch.bwd_grads_wy_warps, grads_stages,
                {"BKS": tile["grads_BKS"]}),) if delta else ())):
        const = {a: v for a, v in dict(consts, BV=bv, **extra).items()
                 if a in fn.arg_names}
        # T, H, K, V are runtime arguments of the backward (constexprs in the forward)
        sig = {a: ("fp32" if a == "scale" else "i32" if a in ("T", "H", "K", "V", "NV", "NVD", "NVS", "NVO", "NC")
                   else "*i8" if a == "ostep" else "*i32" if a in _BWD_I32 else "*fp32" if a in fp32_args or fp32 else "*bf16")
               for a in fn.arg_names if a not in const}
        # the launch's integers at B8 T4096 H16: NC chunks; on the saved states _exact reads no
        # hflag (NV 0) and _prep the output kernel's record over its V tiles (NVO)
        nvo = -(-V // cf.out_launch(tile["BK"], V, gate, torch.float32 if fp32 else torch.bfloat16)["BV"])
        ints = {"T": 4096, "H": 16, "K": K, "V": V, "NVS": -(-V // bvd), "NVO": nvo,
                "NC": 8 * -(-4096 // C), "NV": 0 if saved else -(-V // tile["BV"])}
        # Triton makes an integer argument equal to 1 a constant, as here
        const.update({a: 1 for a in sig if ints.get(a) == 1})
        sig = {a: t for a, t in sig.items() if a not in const}
        aligned = tuple(a for a, t in sig.items() if t.startswith("*") or ints.get(a, 1) % 16 == 0)
        part = {0: " (matrix part)", 1: " (resume part)"}.get(extra.get("PART")) or ""
        yield (f"bwd {fn.__name__}{part}", fn, sig, const, warps, stages, aligned, None)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--K", type=int, default=128)
    ap.add_argument("--V", type=int, default=128)
    ap.add_argument("--gate", type=int, default=1, help="0 none, 1 scalar, 2 vector")
    ap.add_argument("--no-delta", action="store_true")
    ap.add_argument("--only", default="", help="only kernels whose label contains this (e.g. _prep)")
    ap.add_argument("--unaligned", action="store_true",
                    help="compile without the launch's divisibility-by-16 hints (numbers before 2026-11-30)")
    ap.add_argument("--warps", type=int, default=0,
                    help="compile with this many warps instead of the launch's")
    ap.add_argument("--stages", type=int, default=0,
                    help="compile with this many pipeline stages instead of the launch's")
    ap.add_argument("--fp32", action="store_true", help="fp32 inputs (bf16 otherwise)")
    ap.add_argument("--given-t", action="store_true",
                    help="the backward's _prep on the forward's T (the op's path), not forming its own")
    ap.add_argument("--saved", action="store_true",
                    help="the backward's _prep with W and U from the forward (the op's save_states)")
    ap.add_argument("--maxnreg", type=int, default=0,
                    help="cap the registers a thread (Triton's maxnreg) instead of the launch's cap")
    ap.add_argument("--state-bv", type=int, default=64,
                    help="the state pass's matrix part at this V tile (its autotuned configs: 16, 32, 64)")
    a = ap.parse_args()
    print("| kernel | warps | registers | stack (spill) bytes | shared bytes | layout conversions | smem buffers "
          "| async copies | loop: instructions, barriers, shuffles, LDG | unwritten uniform reads | PTX code (md5) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    shape = (a.K, a.V, a.gate, not a.no_delta, a.fp32)
    for label, fn, sig, const, warps, stages, aligned, cap in [*gdn_kernels(*shape, state_bv=a.state_bv),
                                                               *gdn_bwd_kernels(*shape, given_t=a.given_t, saved=a.saved)]:
        if a.only not in label:
            continue
        warps, stages = a.warps or warps, a.stages or stages
        r = resources(fn, sig, const, warps, stages, () if a.unaligned else aligned, a.maxnreg or cap)
        print(f"| {label} | {warps} | {r['registers']} | {r['stack']} | {r['shared']} | "
              f"{r['convert_layout']} | {r['local_alloc']} | {r['async_copies']} | {r['loop_instructions']}, "
              f"{r['loop_barriers']}, {r['loop_shuffles']}, {r['loop_ldg']} | {r['unwritten_uniform']} | "
              f"{r['ptx']} |", flush=True)


if __name__ == "__main__":
    main()
