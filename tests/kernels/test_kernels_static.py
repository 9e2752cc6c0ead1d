"""The arithmetic of bench/kernels_static.py (the sm_90a static table): SASS counting and
occupancy, on small hand-made inputs (no compiler needed)."""
import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "bench" / "kernels_static.py"
_spec = importlib.util.spec_from_file_location("kernels_static", _PATH)
KS = importlib.util.module_from_spec(_spec)
sys.modules["kernels_static"] = KS  # dataclasses look their module up
_spec.loader.exec_module(KS)


@pytest.mark.parametrize("threads, regs, shared, want", [
    (256, 32, 0, 1.0),        # 8 blocks x 8 warps = 64 warps
    (256, 40, 0, 0.75),       # 40 x 32 = 1280 registers per warp: 6 blocks
    (256, 64, 0, 0.5),
    (256, 255, 0, 0.125),
    (512, 48, 0, 0.5),        # 48 x 32 x 16 warps = 24576 registers per block: 2 blocks, 32 warps
    (256, 32, 60 * 1024, 0.375),  # shared memory: 228 KiB // 61 KiB = 3 blocks
    (32, 16, 0, 0.5),         # the 32-blocks-per-SM limit: 32 warps
])
def test_occupancy(threads, regs, shared, want):
    assert KS.occupancy(threads, regs, shared) == pytest.approx(want)


def test_executed_instructions_skips_slow_paths_and_weights_loops():
    instrs = [
        (0x00, "S2R R0, SR_TID.X"),
        (0x10, "@!P0 BRA `(.L_x_1)"),               # jumps over the slow-path call
        (0x20, "CALL.REL.NOINC `($__internal_0_$slowpath)"),
        (0x30, "FADD R1, R1, R2"),
        (0x40, "FMUL R1, R1, R3"),                  # loop body ...
        (0x50, "@P1 BRA `(.L_x_2)"),                # ... back to 0x40
        (0x60, "NOP"),
        (0x70, "EXIT"),
        (0x80, "BRA `(.L_x_3)"),                    # the trap loop after EXIT
        (0x90, "RET.REL.NODEC R0"),                 # the subroutine
    ]
    labels = {".L_x_1": 0x30, ".L_x_2": 0x40, ".L_x_3": 0x80, "$__internal_0_$slowpath": 0x90}
    total, note = KS.executed_instructions((instrs, labels), [5])
    # S2R, BRA, FADD, EXIT once; FMUL and the back-branch 5 times; CALL, NOP, trap, RET never
    assert (total, note) == (4 + 2 * 5, "")
    assert KS.executed_instructions((instrs, labels), None)[0] == 6
    total, note = KS.executed_instructions((instrs, labels), [])
    assert total != total and "1 loops" in note  # trip counts missing: no number, a note


def test_spill_parsing():
    log = """ptxas info    : Compiling entry function 'k1' for 'sm_90a'
ptxas info    : Function properties for k1
    0 bytes stack frame, 16 bytes spill stores, 16 bytes spill loads
ptxas info    : Compiling entry function 'k2' for 'sm_90a'
ptxas info    : Function properties for k2
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads"""
    assert KS._parse_spills(log) == {"k1": 16, "k2": 0}
