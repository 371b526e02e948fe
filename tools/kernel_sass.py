"""The 4-bit decode kernels (services/talker/kv_int4.py) compiled for a GPU on a machine without one: registers,
spills, shared memory and the instructions of the main loop, per code, for each launch named.

    python -m tools.kernel_sass [--arch 90] [--out DIR] LAUNCH ...    # e.g. planes,128,4,3,1 mma,256,4,1,1

Needs Triton (`pip install triton`; its wheel carries ptxas and cuobjdump), no CUDA device or driver. The shapes
are the serving ones (bf16 query, head_dim 128) with the argument alignment the GPU run sees. "per code" divides
the loop's instructions per thread by the codes each thread handles per block (2 * block_n * head_dim / threads):
the kernel is at its bandwidth floor when that, times the codes of a layer, issues within the layer's read time
(bench/RESULTS.md). Writes <launch>.{ttgir,ptx,sass} under --out (default: a temporary directory).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from services.talker import kv_int4
from services.talker.kv_int4 import Kernel, Launch

HEAD_DIM = 128
# Pointers (16-byte aligned, as torch allocates) and the strides that are multiples of 16 at the serving shape;
# the meta's head stride (the context, 3000) is not.
ALIGNED = ("Q", "K", "V", "KS", "KZ", "VS", "VZ", "SLOTS", "NVALID", "OUT", "s_qb", "s_qh", "s_ks", "s_kh", "s_kc",
           "s_ms", "s_ob", "s_oh")


def compile_launch(launch: Launch, arch: int):
    import triton
    from triton.backends.compiler import GPUTarget

    words = "*i32"
    common = {"Q": "*bf16", "SLOTS": "*i64", "NVALID": "*i64", "OUT": "*bf16", "sm_scale": "fp32"}
    if launch.kernel is Kernel.TILE:
        kernel = kv_int4._decode_int4_tile_kernel
        sig = {**common, "K": "*u8", "V": "*u8", **{m: "*fp16" for m in ("KS", "KZ", "VS", "VZ")}}
        consts = {"HALF": HEAD_DIM // 2, "BLOCK_N": launch.block_n, "EXACT_BITS": launch.exact_bits}
    else:
        kernel = {Kernel.PLANES: kv_int4._decode_int4_planes_kernel, Kernel.MMA: kv_int4._decode_int4_mma_kernel}[
            launch.kernel]
        sig = {**common, "K": "*u8" if launch.kernel is Kernel.MMA else words, "V": words, "nibble": "i32",
               "magic": "i32", **{m: words for m in ("KS", "KZ", "VS", "VZ")}}
        rows = min(launch.block_n, launch.num_warps * 128 // max(4, HEAD_DIM // 8))  # as kv_int4.launch_int4
        consts = {"HALF": HEAD_DIM // 2, "BLOCK_N": launch.block_n, "ROWS": rows, "NUM_STAGES": launch.num_stages}
        if launch.kernel is Kernel.MMA:
            consts["INTERPRET"] = False
    names = kernel.arg_names
    signature = {n: "constexpr" if n in consts else sig.get(n, "i32") for n in names}
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in ALIGNED if n in names}
    src = triton.compiler.ASTSource(fn=kernel, constexprs=consts, signature=signature, attrs=attrs)
    target = GPUTarget("cuda", arch, 32)
    options = triton.compiler.make_backend(target).parse_options({"num_warps": launch.num_warps,
                                                                    "num_stages": launch.num_stages})
    return triton.compile(src, target=target, options=options.__dict__)


def loop_opcodes(sass: str) -> tuple[int, collections.Counter]:
    """Instructions in the longest loop (a backward branch's range) of a cuobjdump -sass listing, by opcode."""
    ins = [(int(m.group(1), 16), m.group(2).strip()) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)]
    loops = [(int(m.group(1), 16), a) for a, t in ins if (m := re.search(r"BRA (0x[0-9a-f]+)", t))
             and int(m.group(1), 16) < a]
    if not loops:
        return 0, collections.Counter()
    lo, hi = max(loops, key=lambda r: r[1] - r[0])
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for a, t in ins
                              if lo <= a <= hi)
    return sum(ops.values()), ops


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("launches", nargs="+", help="KERNEL,BLOCK_N,WARPS,STAGES,EXACT_BITS (kv_int4.Launch)")
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: Hopper)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    try:
        launches = [Launch.parse(x) for x in args.launches]
    except ValueError as e:
        ap.error(str(e))
    if kv_int4.triton is None:
        print("tools.kernel_sass needs Triton: pip install triton", file=sys.stderr)
        return 2
    import triton

    out = Path(args.out or tempfile.mkdtemp(prefix="kernel-sass-"))
    out.mkdir(parents=True, exist_ok=True)
    cuobjdump = Path(os.path.dirname(triton.__file__)) / "backends/nvidia/bin/cuobjdump"
    for launch in launches:
        k = compile_launch(launch, args.arch)
        name = str(launch).replace(",", "_")
        cubin = out / f"{name}.cubin"
        cubin.write_bytes(k.asm["cubin"])
        for ext in ("ttgir", "ptx"):
            (out / f"{name}.{ext}").write_text(k.asm[ext])
        sass = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True).stdout
        (out / f"{name}.sass").write_text(sass)
        usage = subprocess.run([cuobjdump, "--dump-resource-usage", cubin], capture_output=True, text=True).stdout
        regs = re.search(r"REG:(\d+)", usage)
        local = re.search(r"LOCAL:(\d+)", usage)
        total, ops = loop_opcodes(sass)
        codes = 2 * launch.block_n * HEAD_DIM / (launch.num_warps * 32)
        print(f"{launch}: {regs.group(1) if regs else '?'} registers, {local.group(1) if local else '?'} B spilled, "
              f"{k.metadata.shared} B shared; loop {total} instructions, {total / codes:.2f} per code; "
              + ", ".join(f"{op} {c}" for op, c in ops.most_common(8)))
    print(f"listings under {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
