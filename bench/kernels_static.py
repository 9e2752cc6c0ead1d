"""Static performance table of slimfit's GPU kernels for Hopper (sm_90a), built without a GPU.

Every Triton kernel and variant the launchers use is compiled for sm_90a with `triton.compile`
(Triton's own ptxas), the CUDA kernels of csrc/cuda with `nvcc -arch=sm_90a` (the device code
of quantize_kernels.cuh, every template instance). For each kernel:

  regs      registers per thread (cuobjdump --dump-resource-usage of the cubin)
  spills    bytes of spill stores (ptxas -v) -- any spill is a miss
  local     bytes of local memory (spills and stack arrays)
  instr/elem  SASS instructions a thread executes, times threads per program, over the
            elements a program handles: the straight-line main path (from the entry to the
            last EXIT before the out-of-line subroutines, e.g. the IEEE-division slow path),
            loops counted with their trip counts. The CUDA kernels are counted in their steady
            state: compiled a second time with SLIMFIT_STATIC_COUNT_FULL_VECTORS, which compiles
            out the scalar tail path of the last partial vector (registers, spills and occupancy
            come from the kernels as built).
  occupancy theoretical, H100 SXM: 64 warps, 65536 registers, 32 blocks and 228 KiB of shared
            memory per SM, registers allocated per warp in units of 256.

Targets (issue 16): no spills anywhere; quantize/dequantize at most 64 registers; 8-bit nearest
quantize/dequantize at most 20 instructions per element; full occupancy for the CUDA kernels.
Each target row is printed as met/MISSED.

    python -m bench.kernels_static            # table + bench/results/kernels_static_sm90.{md,csv}
    python -m bench.kernels_static --quick    # fewer variants (smoke test)
    python -m bench.kernels_static --only topk  # some Triton kernels, printed only
    python -m bench.kernels_static --from-csv # the .md again from the .csv (no compile)
    python -m bench.kernels_static --from-csv --compare 53f3e26:bench/results/kernels_static_sm90_before.csv \
        --compare-note "..."                  # beside each row, the registers and instr/elem of another
                                              # table: a CSV file, or REV:PATH from git history (here the
                                              # kernels before issue 16's rework); the note says what it is
"""
from __future__ import annotations

if __name__ == "__main__" and not __package__:  # file form: python bench/kernels_static.py (bench/_shim.py)
    import _shim
    _shim.run_as_module(__file__)

import argparse
import csv
import dataclasses
import importlib
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench import _results

ROOT = Path(_results.ROOT)
RESULTS = Path(_results.RESULTS_DIR)

# H100 SXM (sm_90) per-SM limits.
SM_WARPS, SM_REGS, SM_BLOCKS, SM_SMEM, SMEM_RESERVED = 64, 65536, 32, 228 * 1024, 1024


@dataclasses.dataclass
class Row:
    backend: str
    kernel: str
    variant: str
    threads: int          # per block / program
    elems: int            # elements a block / program handles
    regs: int = 0
    spills: int = 0
    local: int = 0
    shared: int = 0
    instr: float = float("nan")       # executed per thread (main path, loops unrolled by trip count)
    per_elem: float = float("nan")
    occupancy: float = 0.0
    note: str = ""


# ------------------------------------------------------------------ tools
def triton_bin(name: str) -> str:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if path.exists():
        return str(path)
    found = shutil.which(name)
    if not found:
        raise SystemExit(f"kernels_static: {name} not found (Triton's nvidia backend bundles it)")
    return found


def resource_usage(cubin: Path) -> dict[str, dict]:
    """function name -> {'regs', 'stack', 'shared', 'local'} from cuobjdump."""
    out = subprocess.run([triton_bin("cuobjdump"), "--dump-resource-usage", str(cubin)],
                         capture_output=True, text=True, check=True).stdout
    res, name = {}, None
    for line in out.splitlines():
        m = re.match(r"\s*Function (\S+):", line)
        if m:
            name = m.group(1)
            continue
        m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", line)
        if m and name:
            res[name] = dict(zip(("regs", "stack", "shared", "local"), map(int, m.groups())))
    return res


def sass_functions(cubin: Path) -> dict[str, tuple[list[tuple[int, str]], dict[str, int]]]:
    """function name -> ([(address, instruction)], {label: address}) from nvdisasm."""
    out = subprocess.run([triton_bin("nvdisasm"), "-c", str(cubin)], capture_output=True, text=True,
                         check=True).stdout
    funcs: dict[str, tuple[list, dict]] = {}
    cur = None
    pending: list[str] = []
    for line in out.splitlines():
        m = re.match(r"\s*\.section\s+\.text\.(\S+?),", line)
        if m:
            cur = m.group(1)
            funcs[cur] = ([], {})
            pending = []
            continue
        m = re.match(r"^([.$\w]+):\s*$", line.strip())
        if m and cur:
            pending.append(m.group(1))
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if m and cur:
            addr = int(m.group(1), 16)
            for label in pending:
                funcs[cur][1][label] = addr
            pending = []
            funcs[cur][0].append((addr, m.group(2).strip()))
    return funcs


def executed_instructions(sass: tuple[list[tuple[int, str]], dict[str, int]],
                          loop_trips: list[int] | None) -> tuple[float, str]:
    """Instructions one thread executes on the main path of a kernel:
    * the kernel body only: everything before the first out-of-line subroutine ($... label);
    * NOPs and the trailing self-branch after the last EXIT left out;
    * a region skipped by a forward branch that contains a CALL (the IEEE-division slow path)
      left out: it runs only for operands the fast path cannot handle;
    * every other instruction weighted by the trip counts of the loops (backward branches)
      around it; loop_trips gives them in order of their start address (None: every loop
      body counted once, for loops over a runtime bound such as a tail). Loops the compiler
      unrolled are straight-line code: when fewer loops than trip counts are found and the
      trip counts are all equal, each loop found runs that many times."""
    instrs, labels = sass
    sub_starts = [a for name, a in labels.items() if name.startswith("$")]
    end = min(sub_starts) if sub_starts else max(a for a, _ in instrs) + 16
    body = [(a, t) for a, t in instrs if a < end and not t.startswith("NOP")]
    skipped: list[tuple[int, int]] = []
    loops: list[tuple[int, int]] = []
    for addr, text in body:
        m = re.search(r"\bBRA\b.*?\(([.$\w]+)\)", text)
        if not m or m.group(1) not in labels:
            continue
        dest = labels[m.group(1)]
        if dest == addr:
            skipped.append((addr, addr))  # the trap loop after EXIT
        elif dest < addr:
            loops.append((dest, addr))
        elif any("CALL" in t for a, t in body if addr < a < dest):
            skipped.append((addr + 1, dest - 1))
    counted = [(a, t) for a, t in body if not any(lo <= a <= hi for lo, hi in skipped)]
    if loop_trips is None:  # runtime-bounded loops (tail paths): each body counted once
        loop_trips = [1] * len(loops)
    if len(loops) < len(loop_trips) and len(set(loop_trips)) == 1:
        # the compiler unrolled some loops (their copies are straight-line code); the others
        # still run the one trip count they all share
        loop_trips = loop_trips[:len(loops)]
    if len(loops) != len(loop_trips):
        return float("nan"), f"{len(loops)} loops in the SASS, {len(loop_trips)} trip counts known"
    trips = list(zip(sorted(loops), loop_trips))
    total = 0.0
    for addr, _ in counted:
        w = 1
        for (lo, hi), n in trips:
            if lo <= addr <= hi:
                w *= n
        total += w
    return total, ""


def occupancy(threads: int, regs: int, shared: int) -> float:
    warps = math.ceil(threads / 32)
    regs_per_warp = math.ceil(max(regs, 1) * 32 / 256) * 256
    by_regs = SM_REGS // (regs_per_warp * warps)
    by_warps = SM_WARPS // warps
    by_smem = SM_SMEM // (shared + SMEM_RESERVED) if shared else SM_BLOCKS
    blocks = min(by_regs, by_warps, by_smem, SM_BLOCKS)
    return blocks * warps / SM_WARPS


def ptxas_spills(ptx: str, opts: list[str]) -> dict[str, int]:
    """function -> spill-store bytes, from `ptxas -v` on Triton's PTX (same flags as Triton)."""
    with tempfile.TemporaryDirectory() as d:
        src = Path(d) / "k.ptx"
        src.write_text(ptx)
        from triton.backends.nvidia.compiler import get_ptxas  # the ptxas Triton itself runs for sm_90

        cmd = [get_ptxas(90).path, *opts, "-v", "--regAllocOptLevel=2", "--gpu-name=sm_90a", str(src),
               "-o", str(Path(d) / "k.o")]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return _parse_spills(out.stderr + out.stdout)


def _parse_spills(text: str) -> dict[str, int]:
    spills, name = {}, None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '(\S+)'", line) or re.search(r"Function properties for (\S+)", line)
        if m:
            name = m.group(1)
        m = re.search(r"(\d+) bytes spill stores", line)
        if m and name:
            spills[name] = int(m.group(1))
    return spills


# ------------------------------------------------------------------ Triton kernels
def _triton_variants(quick: bool):
    q = importlib.import_module("slimfit.kernels.triton.quantize")
    t = importlib.import_module("slimfit.kernels.triton.topk")
    b = importlib.import_module("slimfit.kernels.triton.bits")
    dr = importlib.import_module("slimfit.kernels.triton.dropout")
    import torch

    big = 1 << 24  # a large tensor: launchers pick their full block sizes

    ptr = {"fp32": "*fp32", "bf16": "*bf16", "fp16": "*fp16"}
    groups = (128,) if quick else (32, 64, 128, 256)
    in_dtypes = ("fp32",) if quick else ("fp32", "bf16")
    for dt in in_dtypes:
        for gs in groups:
            for bits in (2, 4, 8):
                for stoch in (False, True):
                    cfg = q.launch_config(gs, big // gs, stoch)
                    yield dict(
                        kernel="quantize", fn=q._quantize_kernel,
                        variant=f"{dt} g{gs} {bits}-bit {'stochastic' if stoch else 'nearest'}",
                        sig=q.kernel_signature(ptr[dt], stochastic=stoch),
                        const=cfg.constexprs(bits, gs, stoch),
                        num_warps=cfg.num_warps, elems=cfg.elements, loops=[],
                        target=("quantize", bits, stoch),
                    )
    for dt in in_dtypes:
        for gs in groups:
            for bits in (2, 4, 8):
                cfg = q.launch_config(gs, big // gs)
                yield dict(
                    kernel="dequantize", fn=q._dequantize_kernel, variant=f"-> {dt} g{gs} {bits}-bit",
                    sig=q.dequantize_signature(ptr[dt]), const=cfg.dequant_constexprs(bits, gs),
                    num_warps=cfg.num_warps, elems=cfg.elements, loops=[], target=("dequantize", bits, False),
                )
    yield from _blockwise_variants(quick, big, ptr, in_dtypes)
    yield from _adam_variants(quick)
    # top-k prune: the chunking the launcher picks for each row length; 197 (ViT-B/16 tokens),
    # 768 (LayerNorm rows), 2048, 3000, 8192 (the longest row in one chunk), 16384 and 65536.
    row_lengths = (197, 768) if quick else (197, 768, 2048, 3000, 8192, 16384, 65536)
    for row in row_lengths:
        cfg = t.tile_config(row, big // row)
        for mag in (True, False):
            yield dict(
                kernel="topk_prune", fn=t._topk_kernel, variant=f"row {row} {'|x|' if mag else 'x'}",
                sig=t.tile_signature("*fp32", t.topk_index_dtype(row)),
                const=cfg.constexprs(mag), num_warps=cfg.num_warps, elems=cfg.elements(row),
                loops=cfg.loop_trips, target=None, note=f"{cfg.n_chunks} x {cfg.block} lanes",
            )
    for row in ((197, 768) if quick else (197, 768, 2048, 16384)):
        k = max(1, row // 10)
        cfg = t.restore_config(row, k, big // row)
        idx = t.topk_index_dtype(row)
        yield dict(
            kernel="topk_restore", fn=t._topk_restore_kernel,
            variant=f"row {row} k {k} fp32, {str(idx).replace('torch.', '')} idx",
            sig=t.restore_signature("*fp32", {torch.int16: "*i16", torch.int32: "*i32"}[idx]),
            const=cfg.constexprs(), num_warps=cfg.num_warps, elems=cfg.elements(row), loops=cfg.loop_trips,
            target=None, note=f"{cfg.rows} row(s) per program, writes whole rows",
        )
    yield dict(
        kernel="pack_bits", fn=b._pack_bits_kernel, variant="", sig={"mask_ptr": "*u8", "out_ptr": "*u8",
        "n_elements": "i32", "n_bytes": "i32", "BLOCK_BYTES": "constexpr"}, const={"BLOCK_BYTES": b.BLOCK_BYTES},
        num_warps=b.NUM_WARPS, elems=8 * b.BLOCK_BYTES, loops=[], target=None,
    )
    yield dict(
        kernel="unpack_bits", fn=b._unpack_bits_kernel, variant="", sig={"packed_ptr": "*u8", "out_ptr": "*u8",
        "n_elements": "i32", "n_bytes": "i32", "BLOCK_BYTES": "constexpr"}, const={"BLOCK_BYTES": b.BLOCK_BYTES},
        num_warps=b.NUM_WARPS, elems=8 * b.BLOCK_BYTES, loops=[], target=None,
    )
    yield dict(
        kernel="dropout_mask", fn=dr._dropout_mask_kernel, variant="", sig={"out_ptr": "*u8", "n_elements": "i32",
        "p": "fp32", "k0": "i32", "k1": "i32", "BLOCK": "constexpr"}, const={"BLOCK": dr.BLOCK},
        num_warps=dr.NUM_WARPS, elems=dr.BLOCK, loops=[], target=None,
    )
    for dt in in_dtypes:
        yield dict(
            kernel="seeded_dropout", fn=dr._seeded_dropout_kernel, variant=dt,
            sig={"x_ptr": ptr[dt], "out_ptr": ptr[dt], "n_elements": "i32", "p": "fp32", "factor": "fp32",
                 "k0": "i32", "k1": "i32", "BLOCK": "constexpr"}, const={"BLOCK": dr.BLOCK},
            num_warps=dr.NUM_WARPS, elems=dr.BLOCK, loops=[], target=None,
        )
    rs = importlib.import_module("slimfit.kernels.triton.round_stochastic")
    for kernel, fn, x_ptr, out_ptr in (("round_stochastic", rs._round_bf16_kernel, "*i32", "*i16"),
                                       ("round_stochastic", rs._round_fp16_kernel, "*fp32", "*fp16")):
        yield dict(
            kernel=kernel, fn=fn, variant="bf16" if out_ptr == "*i16" else "fp16",
            sig={"x_ptr": x_ptr, "out_ptr": out_ptr, "n_elements": "i32", "k0": "i32", "k1": "i32",
                 "BLOCK": "constexpr"}, const={"BLOCK": rs.BLOCK},
            num_warps=rs.NUM_WARPS, elems=rs.BLOCK, loops=[], target=None,
        )


def _adam_variants(quick: bool):
    """The held Adam step (slimfit::adam_blockwise_): fp32 and bf16 weights (stochastic rounding), 8- and 4-bit
    moments, stochastic codes, blocks of 128, AdamW's decay, without and with the scheduler's relative score sums;
    the pieces' addresses and counts aligned (ALIGN_ALL, the usual case), and one variant assuming nothing."""
    ab = importlib.import_module("slimfit.kernels.triton.adam_blockwise")
    bs = 128
    blocks = ab.blocks_per_program(bs, 1 << 20)
    kinds = {"fp32": ab.W_FP32, "bf16": ab.W_BF16}
    configs = [(w, bits, score, ab.ALIGN_ALL) for w in (("fp32",) if quick else ("fp32", "bf16"))
               for bits in (8, 4) for score in (0, 1)] + [("bf16", 8, 1, ab.ALIGN_ANY)]
    for w, bits, score, align in configs:
        const = dict(W_KIND=kinds[w], G_KIND=kinds[w], WD_MODE=ab.WD_DECOUPLED, ROUND_WEIGHTS=w != "fp32",
                     STOCHASTIC=True, BLOCK_SIZE=bs, BLOCKS=blocks, ALIGN=align, SCORE=score,
                     LOG2_BLOCK=bs.bit_length() - 1, BITS=bits)
        yield dict(kernel="adam_blockwise_", fn=ab._adam_blockwise_kernel,
                   variant=f"{w} b{bs} {bits}-bit{' scored' if score else ''}{'' if align else ' unaligned'}",
                   sig=ab.kernel_signature(), const=const,
                   num_warps=ab.num_warps(blocks * bs, align, bool(score) or bits == 4),
                   elems=blocks * bs, loops=[], target=None)


def _blockwise_variants(quick: bool, big: int, ptr: dict, in_dtypes):
    """Block-wise dynamic quantization (the optimizer codec's): 8- and 4-bit maps, the codec's block 128 and
    bitsandbytes' 256 (and 2048 in the full table); its binary search is BITS gathers from the midpoint table."""
    bq = importlib.import_module("slimfit.kernels.triton.quantize_blockwise")
    blocks = (128,) if quick else (128, 256, 2048)
    for kernel, fn in (("quantize_blockwise", bq._quantize_blockwise_kernel),
                       ("dequantize_blockwise", bq._dequantize_blockwise_kernel)):
        for dt in in_dtypes:
            for bs in blocks:
                for bits in (4, 8):
                    per_program = bq.blocks_per_program(bs, big // bs)
                    quantize = kernel == "quantize_blockwise"
                    sig = bq.kernel_signature(ptr[dt]) if quantize else bq.dequantize_signature(ptr[dt])
                    yield dict(kernel=kernel, fn=fn, variant=f"{'' if quantize else '-> '}{dt} b{bs} {bits}-bit",
                               sig=sig, const={"BITS": bits, "BLOCK_SIZE": bs, "BLOCKS": per_program},
                               num_warps=bq.NUM_WARPS, elems=bs * per_program, loops=[], target=None)


def _attrs(fn, sig: dict) -> dict:
    """Divisibility-16 hints the launcher would see for a large, aligned tensor: every pointer
    and every integer size argument (what Triton specializes on at run time), except the
    do_not_specialize arguments (the seed keys)."""
    skip = set(getattr(fn, "do_not_specialize", ()) or ())
    skip |= {fn.arg_names[i] for i in skip if isinstance(i, int)}
    attrs = {}
    for i, name in enumerate(fn.arg_names):
        ty = sig.get(name)
        if ty is None or ty == "constexpr" or name in skip:
            continue
        if ty.startswith("*") or ty in ("i32", "i64"):
            attrs[(i,)] = [["tt.divisibility", 16]]
    return attrs


def compile_triton(quick: bool, only: str | None = None) -> list[Row]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for v in _triton_variants(quick):
            if only and only not in v["kernel"]:
                continue
            src = ASTSource(v["fn"], signature=v["sig"], constexprs=v["const"], attrs=_attrs(v["fn"], v["sig"]))
            k = triton.compile(src, target=target, options={"num_warps": v["num_warps"], "enable_fp_fusion": False})
            cubin = Path(d) / "k.cubin"
            cubin.write_bytes(k.asm["cubin"])
            name = k.metadata.name
            use = resource_usage(cubin)[name]
            spills = ptxas_spills(k.asm["ptx"], ["--fmad=false"]).get(name, 0)
            threads = v["num_warps"] * 32
            instrs = sass_functions(cubin)[name]
            executed, note = executed_instructions(instrs, v["loops"])
            note = "; ".join(n for n in (v.get("note", ""), note) if n)
            shared = max(use["shared"], int(k.metadata.shared))
            rows.append(Row("triton", v["kernel"], v["variant"], threads, v["elems"], use["regs"], spills,
                            use["local"], shared, executed, executed * threads / v["elems"],
                            occupancy(threads, use["regs"], shared), note))
            print(f"  triton {v['kernel']:<18} {v['variant']:<28} regs {use['regs']:>3}  spills {spills}  "
                  f"{rows[-1].per_elem:6.1f} instr/elem  {note}", flush=True)
    return rows


# ------------------------------------------------------------------ CUDA kernels
_KINDS = {0: ("fp32", "float"), 1: ("fp16", "uint16_t"), 2: ("bf16", "uint16_t")}


def _cuda_stub(quick: bool) -> tuple[str, list[dict]]:
    lines = ['#include "quantize_kernels.cuh"', "namespace slimfit { namespace cuda_impl {"]
    meta = []
    kinds = (0,) if quick else (0, 1, 2)
    groups = (128,) if quick else (32, 64, 128, 256)
    for kind in kinds:
        dt, ctype = _KINDS[kind]
        vec = 16 // (4 if kind == 0 else 2)
        header = (ROOT / "csrc/cuda/quantize_kernels.cuh").read_text()
        m = re.search(r"static constexpr int V = (\d+) / static_cast<int>\(sizeof\(S\)\);", header)
        if not m:
            raise SystemExit("kernels_static: QuantShape::V of quantize_kernels.cuh changed; update the bench")
        v_quant = int(m.group(1)) // (4 if kind == 0 else 2)  # elements per thread
        for gs in groups:
            v_per_thread = v_quant
            for bits in (2, 4, 8):
                for stoch in ("false", "true"):
                    lines.append(f"template __global__ void quantize_kernel<{kind},{gs},{bits},{stoch}>("
                                 f"const {ctype}*, int64_t, int64_t, uint8_t*, float*, float*, cuda_rng::Keys, bool);")
                    rounding = "stochastic" if stoch == "true" else "nearest"
                    meta.append(dict(kernel="quantize", variant=f"{dt} g{gs} {bits}-bit {rounding}",
                                     mangled=f"quantize_kernelILi{kind}ELi{gs}ELi{bits}ELb{int(stoch == 'true')}E",
                                     per_thread=v_per_thread, target=("quantize", bits, stoch == "true")))
        for bits in (2, 4, 8):
            lines.append(f"template __global__ void dequantize_kernel<{kind},{bits}>(const uint8_t*, const float*, "
                         f"const float*, {ctype}*, int64_t, int, bool);")
            meta.append(dict(kernel="dequantize", variant=f"-> {dt} {bits}-bit",
                             mangled=f"dequantize_kernelILi{kind}ELi{bits}E", per_thread=vec,
                             target=("dequantize", bits, False)))
    lines.append("}}")
    return "\n".join(lines) + "\n", meta


def compile_cuda(quick: bool) -> list[Row]:
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        print("  nvcc not found: CUDA kernels skipped")
        return []
    src, meta = _cuda_stub(quick)
    block = int(re.search(r"kBlock = (\d+)", (ROOT / "csrc/cuda/quantize_kernels.cuh").read_text()).group(1))

    def build(d: str, defines: list[str]):
        stub = Path(d) / "stub.cu"
        stub.write_text(src)
        cubin = Path(d) / f"stub{len(defines)}.cubin"
        includes = [f"-I{ROOT / 'csrc' / 'cuda'}", f"-I{ROOT / 'csrc'}"]
        out = subprocess.run([nvcc, "-arch=sm_90a", "-cubin", "-O3", "--fmad=false", "--resource-usage", "-std=c++17",
                              *defines, *includes, "-o", str(cubin), str(stub)], capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(f"kernels_static: nvcc failed:\n{out.stderr[-4000:]}")
        return _parse_spills(out.stdout + out.stderr), resource_usage(cubin), sass_functions(cubin)

    with tempfile.TemporaryDirectory() as d:
        spills, use, _ = build(d, [])  # as built: registers, spills, occupancy
        # the steady state (every vector full and aligned; tail code compiled out) for the count
        _, _, sass = build(d, ["-DSLIMFIT_STATIC_COUNT_FULL_VECTORS"])
    rows = []
    for m in meta:
        name = next(n for n in use if m["mangled"] in n)
        u = use[name]
        executed, note = executed_instructions(sass[name], None)
        row = Row("cuda", m["kernel"], m["variant"], block, block * m["per_thread"], u["regs"],
                  spills.get(name, 0), u["local"], u["shared"], executed, executed / m["per_thread"],
                  occupancy(block, u["regs"], u["shared"]), note)
        rows.append(row)
        print(f"  cuda   {m['kernel']:<18} {m['variant']:<28} regs {u['regs']:>3}  spills {row.spills}  "
              f"{row.per_elem:6.1f} instr/elem", flush=True)
    return rows


# ------------------------------------------------------------------ targets and output
def targets(rows: list[Row]) -> list[tuple[str, bool, str]]:
    out = []
    spilled = [r for r in rows if r.spills or r.local]
    out.append(("no spills / local memory in any kernel", not spilled,
                ", ".join(f"{r.backend} {r.kernel} {r.variant}" for r in spilled[:6]) or "none"))
    for be in ("triton", "cuda"):
        qd = [r for r in rows if r.backend == be and r.kernel in ("quantize", "dequantize")]
        if not qd:
            continue
        worst = max(qd, key=lambda r: r.regs)
        out.append((f"{be} quantize/dequantize <= 64 registers", worst.regs <= 64,
                    f"max {worst.regs} ({worst.kernel} {worst.variant})"))
        n8 = [r for r in qd if "8-bit" in r.variant and "stochastic" not in r.variant]
        worst = max(n8, key=lambda r: r.per_elem)
        out.append((f"{be} 8-bit nearest quantize/dequantize <= 20 instr/elem", worst.per_elem <= 20,
                    f"max {worst.per_elem:.1f} ({worst.kernel} {worst.variant})"))
    cu = [r for r in rows if r.backend == "cuda"]
    if cu:
        worst = min(cu, key=lambda r: r.occupancy)
        out.append(("cuda kernels at full occupancy", worst.occupancy >= 1.0,
                    f"min {worst.occupancy:.0%} ({worst.kernel} {worst.variant}, {worst.regs} regs)"))
    return out


def _load_compare(source: str | None) -> dict:
    """(backend, kernel, variant) -> (regs, instr/elem) of the table `source` names (a CSV path or REV:PATH,
    bench/_results.read_compare_rows); {} without one."""
    if not source:
        return {}
    return {(r["backend"], r["kernel"], r["variant"]): (int(r["regs"]), float(r["per_elem"]))
            for r in _results.read_compare_rows(source)}


def _compared(other: dict, r: Row):
    """The row of the other table that measured the kernel of `r`. Tables that count both roundings of a
    CUDA quantize in one row name its variant '... (nearest+stochastic)'; the top-k kernel of rows padded
    to a power of two is 'topk_prune (tile)' there."""
    if r.kernel == "topk_prune":
        return other.get((r.backend, "topk_prune (tile)", r.variant)) or other.get((r.backend, r.kernel, r.variant))
    return other.get((r.backend, r.kernel, r.variant)) or other.get(
        (r.backend, r.kernel, re.sub(r" (nearest|stochastic)$", " (nearest+stochastic)", r.variant)))


def _produced_by(stem: str) -> str | None:
    """The 'Produced by' paragraph of the existing <stem>.md: the tools the CSV's numbers were compiled with."""
    path = RESULTS / f"{stem}.md"
    lines = path.read_text().splitlines() if path.exists() else []
    return next((line for line in lines if line.startswith("Produced by ")), None)


def _tools_paragraph(argv=()) -> str:
    import triton

    nvcc = subprocess.run(["nvcc", "--version"], capture_output=True, text=True).stdout.strip().splitlines()[-1] \
        if shutil.which("nvcc") else "no nvcc"
    return (f"Produced by `{_results.command('kernels_static', list(argv))}` (triton {triton.__version__}, {nvcc}). "
            "Registers from cuobjdump, spills from ptxas -v, SASS from nvdisasm; instr/elem = instructions a thread "
            "executes on the main path x threads per program / elements per program (CUDA: the steady state, tail "
            "path compiled out); occupancy = theoretical, H100 SXM limits. See the module docstring for the method.")


def write(rows: list[Row], checks, stem: str, compare: str | None = None, produced_by: str | None = None,
          compare_note: str = "") -> None:
    """<stem>.csv and <stem>.md; `compare`: a table shown beside (columns *before*), `compare_note` what it is;
    `produced_by`: the tools paragraph to keep (re-rendering from the CSV), else this machine's."""
    cols = ["backend", "kernel", "variant", "threads", "elems", "regs", "spills", "local", "shared", "instr",
            "per_elem", "occupancy", "note"]
    _results.write_rows(str(RESULTS / f"{stem}.csv"),
                        [[f"{v:.3f}" if isinstance(v, float) else v for v in (getattr(r, c) for c in cols)]
                         for r in rows], cols)
    lines = ["# Static kernel table, sm_90a (H100), no GPU needed", "", produced_by or _tools_paragraph(), "",
             "## Targets", "", "| target | result | detail |", "|---|---|---|"]
    lines += [f"| {name} | {'met' if ok else 'MISSED'} | {detail} |" for name, ok, detail in checks]
    other = _load_compare(compare)
    if other:
        lines += ["", f"Columns *before* come from `{compare}` (`--compare`), matched by backend, kernel and variant"
                  + (f": {compare_note}" if compare_note else ".")]
    lines += ["", "## Kernels", "",
              "| backend | kernel | variant | threads | elems | regs | spills | instr/elem | occupancy |"
              + (" regs before | instr/elem before |" if other else ""),
              "|---|---|---|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if other else "")]
    for r in rows:
        line = (f"| {r.backend} | {r.kernel} | {r.variant} | {r.threads} | {r.elems} | {r.regs} | {r.spills} | "
                f"{r.per_elem:.1f} | {r.occupancy:.0%} |")
        if other:
            b = _compared(other, r)
            line += f" {b[0]} | {b[1]:.1f} |" if b else " | |"
        lines.append(line)
    _results.write_text(str(RESULTS / f"{stem}.md"), "\n".join(lines) + "\n")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few variants only (smoke test)")
    ap.add_argument("--out", default="kernels_static_sm90", help="file stem under bench/results/")
    ap.add_argument("--no-cuda", action="store_true", help="skip the nvcc part")
    ap.add_argument("--compare", default=None, metavar="CSV",
                    help="another table to show beside each row: a CSV file, or REV:PATH of one in git history")
    ap.add_argument("--compare-note", default="", metavar="TEXT", help="what the --compare table is (a sentence)")
    ap.add_argument("--from-csv", action="store_true", help="re-render the .md from the existing .csv (no compile)")
    ap.add_argument("--only", default=None, metavar="NAME",
                    help="compile only the Triton kernels whose name contains NAME and print them (no files written "
                         "unless --out names a stem of their own)")
    return ap


def main(argv=None) -> int:
    # compile real kernels (the interpreter has no cubin); before anything imports triton
    os.environ.pop("TRITON_INTERPRET", None)
    args = parser().parse_args(argv)
    if args.from_csv:
        with open(RESULTS / f"{args.out}.csv") as f:
            rows = [Row(r["backend"], r["kernel"], r["variant"], int(r["threads"]), int(r["elems"]), int(r["regs"]),
                        int(r["spills"]), int(r["local"]), int(r["shared"]), float(r["instr"]), float(r["per_elem"]),
                        float(r["occupancy"]), r["note"]) for r in csv.DictReader(f)]
    else:
        print("Triton kernels (sm_90a):")
        rows = compile_triton(args.quick, args.only)
        if args.only and args.out == parser().get_default("out"):
            return 0   # the full table is not rewritten from a few kernels
        if not args.no_cuda and not args.only:
            print("CUDA kernels (nvcc -arch=sm_90a):")
            rows += compile_cuda(args.quick)
    checks = targets(rows)
    print("\nTargets:")
    for name, ok, detail in checks:
        print(f"  {'met   ' if ok else 'MISSED'}  {name}: {detail}")
    produced = _produced_by(args.out) if args.from_csv else None
    if args.only:   # a table of its own: its command says which kernels
        produced = _tools_paragraph(sys.argv[1:] if argv is None else argv)
    write(rows, checks, args.out, args.compare, produced, args.compare_note)
    print(f"\nwrote bench/results/{args.out}.md and .csv")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
