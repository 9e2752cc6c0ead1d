"""The backends of the kernel tests, behind one interface, and the helpers every op test uses.

A `Backend` exposes each op of `slimfit.kernels._ops.SCHEMAS` as an attribute taking the reference's
positional arguments (`backend.quantize(x, bits, group_size, stochastic, seed)`, ...), and says where
its tensors live. The backends, as dispatch serves them:

  reference  slimfit/kernels/reference.py (the specification) behind the argument checks `_ops` puts
             in front of it (what serves a device nobody else claims, and SLIMFIT_BACKEND=reference)
  native     the C++ CPU kernels of slimfit._C: torch.ops.slimfit on CPU tensors
  triton     the Triton launchers behind the same checks (what `_ops` registers for CUDA), called
             directly: on CPU tensors under TRITON_INTERPRET=1 (set in tests/conftest.py before
             anything imports triton; small shapes, the interpreter is slow), on the GPU otherwise
  cuda       torch.ops.slimfit on CUDA tensors: the extension's CUDA kernels where built, Triton for
             the rest (marked `gpu`)

Every result is compared with the reference run on CPU copies of the same arguments (`check`).
"""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from slimfit.kernels import _ops, backend_info, reference

OPS = tuple(_ops.SCHEMAS)
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
FLOATS = [torch.float32, torch.float16, torch.bfloat16]
BITS = [2, 4, 8]
GROUP_SIZES = [32, 64, 128, 256]


@dataclasses.dataclass(frozen=True)
class Backend:
    name: str
    device: str
    kernels: dict              # op name -> callable with the reference's positional arguments
    errors: tuple              # exception types its argument checks raise
    interpreted: bool = False  # Triton interpreter: fp32 -> bf16 casts truncate, every launch is slow
    dispatched: bool = False   # torch.ops.slimfit (and the slimfit.kernels wrappers) on `device` reach it
    triton_ops: frozenset = frozenset()  # ops it serves with Triton launchers

    def __getattr__(self, op):
        kernels = self.__dict__.get("kernels", {})
        if op in kernels:
            return kernels[op]
        raise AttributeError(op)

    def choose(self, full, interpreted):
        """`full` (the grid of a test), or `interpreted`, its small part run in the Triton interpreter."""
        return interpreted if self.interpreted else full

    def out_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """`dtype` as an output dtype this backend writes faithfully (the interpreter's bf16 -> fp32)."""
        return torch.float32 if self.interpreted and dtype == torch.bfloat16 else dtype

    def __repr__(self):
        return f"Backend({self.name} on {self.device})"


def _checked(module) -> dict:
    return {op: _ops._checked(op, getattr(module, op)) for op in OPS}


def _dispatched() -> dict:
    return {op: getattr(torch.ops.slimfit, op) for op in OPS}


def make_backend(name: str) -> Backend:
    """The backend `name`; pytest.skip (with the reason) where it is not available here."""
    info = backend_info()
    if name == "reference":
        return Backend(name, "cpu", _checked(reference), (ValueError, TypeError),
                       dispatched=info["cpu"] == "reference")
    if name == "native":
        if not info["cpu"].startswith("native"):
            pytest.skip(f"the C++ CPU kernels are not loaded (SLIMFIT_BACKEND={info['requested']}, error: "
                        f"{info['native_error'] or 'none'}); build them with `pip install --no-build-isolation -e .`")
        return Backend(name, "cpu", _dispatched(), (RuntimeError,), dispatched=True)
    if name == "triton":
        device = triton_device()
        try:
            import slimfit.kernels.triton as launchers
        except Exception as exc:  # pragma: no cover - triton missing or too old for the kernels
            pytest.skip(f"slimfit Triton kernels not importable: {type(exc).__name__}: {exc}")
        return Backend(name, device, _checked(launchers), (ValueError, TypeError), interpreted=INTERPRET,
                       triton_ops=frozenset(OPS))
    if name == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("needs a CUDA device")
        return Backend(name, "cuda", _dispatched(), (RuntimeError, ValueError, TypeError), dispatched=True,
                       triton_ops=frozenset(info["cuda_triton_ops"]))
    raise ValueError(name)


def triton_device() -> str:
    """Where Triton runs here: the GPU, or the CPU under TRITON_INTERPRET=1; skips otherwise."""
    if INTERPRET:
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    pytest.skip("no CUDA device and TRITON_INTERPRET is not set")


# ------------------------------------------------------------------------------- inputs
def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(shape, dtype=torch.float32, seed=0, scale=3.0, device="cpu") -> torch.Tensor:
    return (torch.randn(shape, generator=gen(seed)) * scale).to(dtype).to(device)


def ties(shape, dtype=torch.float32, seed=0, device="cpu", low=-3, high=4) -> torch.Tensor:
    """Small integers: many ties."""
    return torch.randint(low, high, shape, generator=gen(seed)).to(dtype).to(device)


def ties_nan_inf(shape, seed, device="cpu") -> torch.Tensor:
    """Small integers (many ties), +-0.0, +-inf and NaNs of both signs, at random places."""
    g = gen(seed)
    x = torch.randint(-3, 4, shape, generator=g).to(torch.float32)
    specials = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), -float("nan")])
    where = torch.rand(shape, generator=g) < 0.1
    x[where] = specials[torch.randint(0, len(specials), (int(where.sum()),), generator=g)]
    return x.to(device)


def non_contiguous(dtype, device="cpu") -> list:
    """A transposed and two strided views (row-major order differs from memory order)."""
    base = randn((77, 6), dtype, seed=7, device=device)
    return [base.t(), base[::2, 1:5], base.t()[:, ::3]]


# ---------------------------------------------------------------------------- comparing
def as_bits(t: torch.Tensor) -> torch.Tensor:
    """Floats as their bits: NaN equals NaN, -0.0 differs from +0.0."""
    if not t.is_floating_point():
        return t
    return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])


def assert_same(got, want, what: str = "", bitwise: bool = False) -> None:
    """Same dtype, shape and values (NaN where `want` has NaN; bit for bit with bitwise=True);
    `got` may live on another device than `want`."""
    if isinstance(want, (tuple, list)):
        assert isinstance(got, (tuple, list)) and len(got) == len(want), (what, type(got))
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{what}[{i}]", bitwise)
        return
    got, want = got.cpu(), want.cpu()
    assert got.dtype == want.dtype, (what, got.dtype, want.dtype)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    if bitwise:
        got, want = as_bits(got), as_bits(want)
    if torch.equal(got, want):
        return
    same = got == want
    if got.is_floating_point():
        same |= torch.isnan(got) & torch.isnan(want)
    if not bool(same.all()):
        bad = (~same).nonzero()
        i = tuple(bad[0].tolist())
        raise AssertionError(f"{what}: {bad.shape[0]} of {got.numel()} differ, first at {i}: {got[i]} vs {want[i]}")


def _cpu(args):
    return [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]


def check(backend: Backend, op: str, *args, bitwise: bool = False):
    """`backend`'s op on args against the reference on CPU copies of them; returns (got, want)."""
    got = getattr(backend, op)(*args)
    for t in got if isinstance(got, (tuple, list)) else (got,):
        assert t.device.type == torch.device(backend.device).type, (op, t.device)
    if backend.name == "reference":  # the reference against itself: nothing to compare
        return got, got
    want = getattr(reference, op)(*_cpu(args))
    assert_same(got, want, f"{backend.name} {op}", bitwise)
    return got, want


# ------------------------------------------------------------- reasons for backend_grid
COMPARED = "a comparison with the reference, which the reference passes by definition"
LAUNCHES = "the interpreter pays per launch: a small part of the grid"

