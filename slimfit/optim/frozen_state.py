"""Optimizer state of frozen layers, not resident in full while they are frozen.

A layer the scheduler freezes keeps its optimizer state (AdamW: ``exp_avg`` and ``exp_avg_sq``, 8 bytes
per parameter in fp32) so that it resumes with its moments when it trains again. While it is frozen
nothing reads that state, so:

  mode="compress"  each moment becomes an 8-bit entry (codec.py: slimfit's quantize, per-group min/max,
                   group 128, stochastic rounding from a seed; a second moment through its square root,
                   never restored below what rounding could have lost): 3.76x fewer bytes. Lossy.
                   code="dynamic" (bits=8 or 4) holds them as block-wise dynamic codes instead (codec.py,
                   dynamic_code.py: the codec of bitsandbytes' 8-bit Adam; 3.88x / 7.53x fewer bytes at block 128).
  mode="offload"   each state tensor moves to host memory (transfer.py: pinned, asynchronous, on a side
                   stream on CUDA) and is copied back when the layer is chosen to train next; the optimizer
                   step waits for that copy on the device, not on the host. Lossless. On the CPU the "host"
                   copy is just another storage (nothing is saved; the path exists to test the logic).

The state stays in ``optimizer.state[p]`` under new keys (``exp_avg@slimfit_q8``: the encoded entry,
``exp_avg@slimfit_host``: the host tensor), so checkpoints carry it, ``slimfit.step_memory`` counts it as
optimizer state, and the scheduler's ``release_state_after`` drops it like any state. Restoring puts the
original keys back right when the scheduler picks the layer for the next step (its frozen-set hook), so the
layer's next optimizer step sees ordinary tensors. A parameter that reaches an optimizer step with its state
still held and a gradient is restored just before that step when it requires grad (a frozen set changed by
hand); when it is frozen (a zero-filled gradient) its gradient is dropped instead, as the scheduler's guard does.

    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    sched = ILSScheduler(model, freeze_rate=0.7, optimizer=opt, optimizer_state="full")
    frozen_state = attach_frozen_state(sched, opt, mode="compress")

With ``between_steps=True`` the state of the trained layers is held too, between their own steps (an 8-bit
AdamW made of slimfit's kernels, when compressing). Under a ChunkedStep (compress only: a plain torch
Adam/AdamW, or the per-parameter optimizers of ``step_in_backward``) the moments are never put back: the
chunked step decodes, updates and encodes them a piece at a time (held_step.py), inside backward for the step
in backward. Without one, an optimizer from ``step_in_backward`` has each parameter's state put back right
before its step inside backward and held again right after it (one parameter's state in full at a time).

``SchedulerConfig.optimizer_state`` attaches one (slimfit/optim/attach.py): "8bit" is compress with
between_steps=True, "8bit-frozen" compress, "host-frozen" offload, "full" none, and "auto", the default, "8bit"
where the optimizer's step can hold every state, else "8bit-frozen" (slimfit/_optimizer_state.py). Or
``attach_frozen_state`` by hand on a scheduler with ``optimizer_state="full"`` (two holders on one scheduler
are refused). What compressing costs in accuracy, and why it is the default: docs/fidelity.md.
"""
from __future__ import annotations

import hashlib
import numbers
import weakref

import torch

from slimfit._optimizer_state import unwrap_optimizer

from . import checkpoint, chunked_step, codec, dynamic_code
from .held_step import new_full_state, new_held_state
from .host_step import new_host_state
from .keys import HOST, Q8, base_key, held_key
from .moments import compress_transform, offloadable
from .sharded_params import blocks_fixed, global_start, like_param, local
from .transfer import transfer_for

__all__ = ["FrozenState", "attach_frozen_state", "MODES"]

MODES = ("compress", "offload")


def _check_options(mode, group_size, seed, code, bits) -> None:
    if mode not in MODES:
        raise ValueError(f"FrozenState: mode must be one of {MODES}, got {mode!r}")
    if isinstance(group_size, bool) or not isinstance(group_size, numbers.Integral) or group_size < 1:
        raise ValueError(f"FrozenState: group_size must be a positive int (128: 8 bytes of scale and offset per "
                         f"128 elements), got {group_size!r}")
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed < 2**62:
        raise ValueError(f"FrozenState: seed must be an int in [0, 2**62), got {seed!r}")
    if code not in codec.CODES:
        raise ValueError(f"FrozenState: code must be one of {codec.CODES} ('linear': 8-bit min/max groups; "
                         f"'dynamic': block-wise dynamic codes, 8 or 4 bits), got {code!r}")
    if isinstance(bits, bool) or not isinstance(bits, numbers.Integral):
        raise ValueError(f"FrozenState: bits must be an int (8, or 4 with code='dynamic'), got {bits!r}")
    try:
        codec.check_code(code, int(bits), int(group_size))
    except ValueError as exc:
        raise ValueError(f"FrozenState: {str(exc).removeprefix('codec: ')}") from None


class FrozenState:
    """Holds the optimizer state of frozen parameters compressed or on the host (see the module docstring).

    ``freeze(params)`` / ``thaw(params)`` do it by hand; ``attach(scheduler)`` has the scheduler call them
    through its frozen-set hook; ``restore_all()`` puts every state back; ``remove()`` restores and detaches.
    ``transfer``: one object with transfer.py's four methods used for every device in place of the
    device's own (slimfit.plan gives one whose host copies a fake CPU run of a CUDA step does not count).
    ``code``/``bits``: how mode="compress" codes a moment: "dynamic" (8 or 4 bits, the default 8, as the
    scheduler's default state_code "dynamic8": block-wise dynamic codes of ``group_size`` elements,
    ``stochastic`` rounding from ``seed``) or "linear" (8 bits: per-group min/max, ``stochastic`` rounding from
    ``seed`` as well; codec.py, dynamic_code.py).
    """

    def __init__(self, optimizer, mode: str = "compress", *, group_size: int = 128, stochastic: bool = True,
                 seed: int = 0, between_steps: bool = False, transfer=None, code: str = "dynamic", bits: int = 8):
        _check_options(mode, group_size, seed, code, bits)
        self.code, self.bits = code, int(bits)
        # held for this object's life (a planned step's fake maps live no longer than it; real ones are cached)
        self._maps = dynamic_code.make_maps(unwrap_optimizer(optimizer), int(bits)) if code == "dynamic" else []
        # Weak: the optimizer's hooks hold this object, so a strong reference back would be a cycle that keeps
        # the optimizer (and the model) alive after the user's last reference goes (tests/test_no_reference_cycles.py).
        # The hooks keep this object alive exactly as long as the optimizer.
        self._optimizer_ref = weakref.ref(unwrap_optimizer(optimizer))
        self.between_steps = bool(between_steps)
        self.mode, self.group_size, self.stochastic, self.seed = mode, int(group_size), bool(stochastic), int(seed)
        # between_steps on a plain optimizer: its ChunkedStep steps the held moments a piece at a time
        self._chunked = None
        if self.between_steps and hasattr(self.optimizer, "register_param_step_post_hook"):
            self._chunked = _in_backward_chunked_step(self.optimizer)
            if self._chunked is not None:
                self._chunked.set_holder(self)
        elif self.between_steps:
            self._chunked = chunked_step.for_optimizer(self.optimizer)
            if self._chunked is None:
                raise ValueError("FrozenState(between_steps=True) holds each trained parameter's state between its "
                                 "own steps, which needs the step of one parameter at a time: build the optimizer "
                                 "with slimfit.optim.step_in_backward, or (a torch Adam/AdamW that is not "
                                 "fused) attach a ChunkedStep first (slimfit.optim.attach_chunked_step; "
                                 "the scheduler attaches one by default)")
            self._chunked.set_holder(self)
        self._index: dict = {}           # id(p) -> its place in the optimizer's parameters (seeds)
        self._pending: dict = {}         # id(p) -> (p, ticket): copies back not yet waited for
        self._transfers: dict = {}       # device -> CpuTransfer / CudaTransfer
        self._one_transfer = transfer    # given: used for every device (slimfit.plan's off-device host)
        self._last_frozen: list = []     # the scheduler's frozen and trained sets at its last hook call
        self._last_trained: list = []
        self._stash: dict = {}           # held entries taken out of a state_dict being loaded (checkpoint.py)
        self._scheduler_handle = None
        self._handles = checkpoint.install(self) + [self._install_step_hook()]

    # ------------------------------------------------------------------ public
    @property
    def optimizer(self):
        optimizer = self._optimizer_ref()
        if optimizer is None:
            raise RuntimeError("FrozenState: its optimizer no longer exists (nothing is held any more)")
        return optimizer

    def attach(self, scheduler) -> "FrozenState":
        """Follow ``scheduler`` (an ILSScheduler): its frozen-set hook calls freeze and thaw from now on
        (at once for the set in force). The experimental ``frozen_update="momentum"`` moves frozen layers by
        their moments every step, so their state cannot be held: ValueError."""
        if scheduler.config.experimental.frozen_update != "none":
            raise ValueError("FrozenState: the scheduler's frozen_update='momentum' steps frozen layers with their "
                             "moments every step, so their optimizer state must stay resident; use the default "
                             "frozen_update='none' with compressed or offloaded frozen state")
        own = getattr(scheduler, "state_holder", None)
        if own is not None and own is not self:
            raise ValueError(f"FrozenState: this scheduler already holds its frozen layers' optimizer state "
                             f"(SchedulerConfig.optimizer_state={scheduler.config.optimizer_state!r}, mode "
                             f"{own.mode!r}); two holders would hold the same state twice. Choose the mode there "
                             "(ILSScheduler(..., optimizer_state='host-frozen')), or build the scheduler with "
                             "optimizer_state='full' (frozen_state=None) to attach your own")
        if self._scheduler_handle is not None:
            self._scheduler_handle.remove()
        self._scheduler_handle = scheduler.register_frozen_set_hook(self._on_frozen_set)
        if self.between_steps:   # every state held: the layers the scheduler does not schedule (embeddings,
            self.freeze(list(self.optimizer.state))   # norms, a head) too, when they already have state (a resume)
            self._make_missing_state({id(p) for _, p in getattr(scheduler, "held_frozen", ())})
        return self

    @torch.no_grad()
    def _make_missing_state(self, never_trained: set) -> None:
        """Under a chunked step, every parameter without optimizer state gets it now (zero moments, step 0: what
        the chunked step makes at the parameter's first step), held (2 bytes a parameter for AdamW), or in full
        where this holder keeps it so (an FSDP2 shard that would cut a block: can_hold). So the optimizer's
        state lists every parameter from the start: torch.distributed.checkpoint loads an optimizer's state into
        the template ``get_state_dict`` makes of the live one, and a layer without state there would not get
        its saved moments back. ``never_trained`` (ids): the parameters the scheduler holds frozen for the whole
        run (its embeddings="freeze"), which never get state."""
        if self._chunked is None:
            return
        opt = self.optimizer
        for group in opt.param_groups:
            for p in group["params"]:
                if opt.state.get(p) or id(p) in never_trained or not chunked_step.layout_ok_without_grad(p):
                    continue
                opt.state[p] = self.new_state(p, group) if self.can_hold(p) else new_full_state(p, group)

    def freeze(self, params) -> int:
        """Compress (or offload) the state of ``params``; how many parameters had state to hold."""
        return sum(self._freeze_one(p) for p in params)

    def thaw(self, params) -> int:
        """Put back the state of ``params`` (a copy back to the device is waited for before the step that
        reads it); how many parameters had held state."""
        return sum(self._thaw_one(p) for p in params)

    def restore_all(self) -> int:
        """Every held state back in full, copies back finished (as far as the device's stream is concerned)."""
        n = self.thaw(self.held_params())
        self.wait()
        return n

    def held_params(self) -> list:
        return [p for p, st in list(self.optimizer.state.items()) if any(held_key(k) for k in st)]

    def held_nbytes(self) -> int:
        """Bytes of the held entries (8-bit codes with scales and offsets, or host copies)."""
        total = 0
        for st in list(self.optimizer.state.values()):
            for k, v in st.items():
                if held_key(k):
                    total += codec.entry_nbytes(v) if isinstance(v, dict) else v.numel() * v.element_size()
        return total

    def wait(self, params=None) -> None:
        """The compute stream waits for the copies back of ``params`` (all pending ones when None)."""
        ids = list(self._pending) if params is None else [id(p) for p in params if id(p) in self._pending]
        for key in ids:
            p, ticket = self._pending.pop(key)
            self._transfer(p.device).wait(ticket)

    def synchronize(self) -> None:
        """The host waits for every copy in flight (before host copies are read: a state_dict)."""
        for transfer in self._transfers.values():
            transfer.synchronize()

    def remove(self) -> None:
        """Restore every state and detach from the optimizer and the scheduler (an optimizer already gone holds
        nothing to restore)."""
        if self._scheduler_handle is not None:
            self._scheduler_handle.remove()
            self._scheduler_handle = None
        if self._optimizer_ref() is not None:
            self.restore_all()
        for h in self._handles:
            h.remove()
        self._handles = []
        if self._chunked is not None:
            self._chunked.set_holder(None)
            self._chunked = None

    # ------------------------------------------------------------------ internals
    def _on_frozen_set(self, frozen, trained) -> None:
        """The scheduler's hook: hold what froze (first, so its bytes go before others come back), put back
        what trains next (nothing once the optimizer is gone: no state is left to hold)."""
        if self._optimizer_ref() is None:
            return
        self._last_frozen, self._last_trained = list(frozen), list(trained)
        self.freeze(frozen)
        if self.between_steps:   # every state held between steps, the trained layers' too (a state made or
            self.freeze(trained)  # put back in full elsewhere is held here); each is stepped from there
        else:
            self.thaw(trained)

    def transfer(self, device: torch.device):
        """The object that moves this holder's host copies to ``device`` and back (transfer.py)."""
        return self._transfer(device)

    def _transfer(self, device: torch.device):
        if self._one_transfer is not None:
            return self._one_transfer
        t = self._transfers.get(device)
        if t is None:
            t = self._transfers[device] = transfer_for(device)
        return t

    def codec_options(self) -> dict:
        """The keywords of codec.encode / codec.zeros_entry this holder codes moments with."""
        return {"group_size": self.group_size, "stochastic": self.stochastic, "code": self.code, "bits": self.bits}

    def can_hold(self, p) -> bool:
        """Whether this holder codes ``p``'s moments: any plain tensor; an FSDP2 shard when its blocks are the
        whole parameter's at this world size (sharded_params.blocks_fixed; else its moments stay in full)."""
        return self.mode != "compress" or blocks_fixed(p, self.group_size)

    def new_state(self, p, group) -> dict:
        """A fresh Adam state for ``p`` held as this holder holds it (8-bit entries, or zeros on the host)."""
        return new_held_state(p, group, self) if self.mode == "compress" else new_host_state(p, group, self)

    def hold(self, p) -> bool:
        """Hold ``p``'s state now (the chunked step, after stepping a state that was in full)."""
        return self._freeze_one(p)

    def seed_for(self, p, key: str, state: dict, start: int = 0) -> int:
        """The stochastic-rounding seed of one entry (from element ``start`` on: a piece the chunked step
        encodes), from this FrozenState's seed, the parameter's place in the optimizer, the entry's name and
        the parameter's optimizer step count: a run resumed from a checkpoint rounds as the uninterrupted one
        did (a running counter would start again at 0)."""
        if id(p) not in self._index:
            self._index = {id(q): i for i, q in enumerate(q for g in self.optimizer.param_groups for q in g["params"])}
        step = state.get("step")
        step = int(step) if isinstance(step, (int, float, torch.Tensor)) else 0
        text = f"{self.seed}:{self._index.get(id(p), -1)}:{key}:{step}" + (f":{start}" if start else "")
        text = text.encode()
        return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little") % 2**62

    @torch.no_grad()
    def _freeze_one(self, p) -> bool:
        state = self.optimizer.state.get(p)
        if not state:
            return False
        held = False
        for key in [k for k in state if not held_key(k)]:
            t = state[key]
            if self.mode == "compress":
                how = compress_transform(key, t, p)
                if how is None or not self.can_hold(p):
                    continue
                # an FSDP2 shard: this rank's piece coded, seeded from where it sits in the whole parameter
                state[key + Q8] = codec.encode(local(t), sqrt=how, seed=self.seed_for(p, key, state,
                                                                                       start=global_start(p)),
                                               **self.codec_options())
            else:
                if not offloadable(key, t, p):
                    continue
                state[key + HOST] = self._transfer(p.device).to_host(local(t))
            del state[key]
            held = True
        if held:
            self._pending.pop(id(p), None)  # a copy back not waited for: the copy out follows it on its stream
        return held

    @torch.no_grad()
    def _thaw_one(self, p) -> bool:
        state = self.optimizer.state.get(p)
        if not state:
            return False
        keys = [k for k in state if held_key(k)]
        for key in keys:
            value = state.pop(key)
            if key.endswith(Q8):
                state[base_key(key)] = like_param(codec.decode(value, device=p.device), p)
            else:
                t, ticket = self._transfer(p.device).to_device(value, p.device)
                state[base_key(key)] = like_param(t, p)
                if ticket is not None:
                    self._pending[id(p)] = (p, ticket)
        return bool(keys)

    def _before_step(self, params) -> None:
        """Right before an optimizer step over ``params`` (None: all), for each held parameter with a gradient:
        frozen (requires_grad False: a zero-filled gradient handed out by other code), the gradient
        is dropped, as the scheduler's guard does, whichever hook runs first (restoring would cost a lossy
        round trip per step); trainable again (a frozen set changed by hand), its state is put back. Then the
        step waits for the copies back."""
        candidates = list(self.optimizer.state.items()) if params is None else \
            [(p, self.optimizer.state.get(p) or {}) for p in params]
        groups = None if self._chunked is None else \
            {id(q): g for g in self.optimizer.param_groups for q in g["params"]}
        for p, st in candidates:
            if p.grad is None or not any(held_key(k) for k in st):
                continue
            if p.requires_grad and groups is not None and self._chunked.takes(p, groups.get(id(p)), st):
                continue   # stepped from its held moments, a piece at a time
            if p.requires_grad:
                self._thaw_one(p)
            else:
                p.grad = None
        self.wait(params)

    def _install_step_hook(self):
        """Per-parameter pre-step hook on an in-backward optimizer (each parameter steps on its own inside
        backward), the optimizer's step pre-hook otherwise."""
        per_param = getattr(self.optimizer, "register_param_step_pre_hook", None)
        if per_param is not None:
            pre = per_param(lambda p: self._before_step([p]))
            if not self.between_steps:
                return pre
            post = self.optimizer.register_param_step_post_hook(self._freeze_one)
            return _Handles(pre, post)
        handle = self.optimizer.register_step_pre_hook(lambda opt, args, kwargs: self._before_step(None))
        chunked_step.run_last(self.optimizer)   # a chunked step reads the state this hook puts back
        return handle


def _in_backward_chunked_step(optimizer):
    """The ChunkedStep hooked on a step in backward's per-parameter optimizers (None: none): held moments (8-bit,
    or on the host) are then stepped a piece at a time inside each parameter's own step, not put back whole
    before it and held again after (a 152k x 896 embedding's two moments: 1 GiB on the device at once)."""
    inner = getattr(optimizer, "optimizers", None)
    if not isinstance(inner, dict):
        return None
    steps = {id(step): step for step in (chunked_step.for_optimizer(o) for o in inner.values()) if step is not None}
    return next(iter(steps.values())) if len(steps) == 1 else None


class _Handles:
    """Several hook handles removed as one."""

    def __init__(self, *handles):
        self.handles = handles

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def attach_frozen_state(scheduler, optimizer, mode: str = "compress", **options) -> FrozenState:
    """A FrozenState over ``optimizer`` following ``scheduler``'s frozen sets (options: group_size,
    stochastic, seed, between_steps, code, bits; see FrozenState)."""
    return FrozenState(optimizer, mode, **options).attach(scheduler)
