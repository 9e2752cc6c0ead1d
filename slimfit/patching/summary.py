"""What a patch did: which modules were patched with which mode, which were left alone and why,
and, for attention, what the calls that ran actually did (counted, not assumed)."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from .attention.routes import calls_of

NOTHING_PATCHED = ("nothing is compressed: no module of this model is one slimfit patches (linear, GELU/SiLU, "
                   "LayerNorm/RMSNorm, dropout, conv, transformers or SDPA attention); its training step is "
                   "plain PyTorch")


@dataclass
class PatchSummary:
    family: str
    patched: list = field(default_factory=list)  # (module name, kind, mode)
    skipped: list = field(default_factory=list)  # (module name, class name, reason)
    attention: str | None = None  # how attention is routed: the model's own implementation, or "F.sdpa"
    notes: tuple = ()  # the family's notes (Family.notes): what its patch does beyond the generic one
    # (name, module) of the routed transformers attention modules, whose call counters the report reads
    attention_modules: list = field(default_factory=list, repr=False, compare=False)
    sdpa_router: object = field(default=None, repr=False, compare=False)  # torch_attention's router, if any

    def counts(self) -> dict:
        return dict(Counter(f"{kind}[{mode}]" for _, kind, mode in self.patched))

    def compresses_anything(self) -> bool:
        """Whether some module was patched (the model-wide SDPA router counts once it routed a call)."""
        routed = self.sdpa_router is not None and self.sdpa_router.mode.routed > 0
        return routed or any(name != "<sdpa>" for name, _, _ in self.patched)

    def attention_calls(self) -> dict:
        """{'modules', 'forwards', 'reached', 'not_reached': [(name, why)]} over the routed attention
        modules: forwards run with gradients, calls that took slimfit's core, and the modules that ran
        forwards with gradients whose attention never reached slimfit."""
        forwards = reached = 0
        not_reached = []
        for name, module in self.attention_modules:
            calls = calls_of(module)
            if calls is None:  # unpatched since
                continue
            forwards += calls.forwards
            reached += calls.reached
            if calls.forwards and not calls.reached:
                why = ", ".join(sorted(calls.fallbacks)) or (
                    "the model computes this attention itself (no call to transformers' attention functions "
                    "or to F.scaled_dot_product_attention)")
                not_reached.append((name, why))
        return {"modules": len(self.attention_modules), "forwards": forwards, "reached": reached,
                "not_reached": not_reached}

    def _attention_lines(self) -> list:
        if self.sdpa_router is not None:
            return [f"  attention: F.scaled_dot_product_attention calls in forward routed; "
                    f"{self.sdpa_router.mode.routed} took slimfit's core so far"]
        if not self.attention_modules:
            return []
        calls = self.attention_calls()
        if not calls["forwards"]:
            return [f"  attention: {calls['modules']} module(s) routed; no training forward run yet"]
        lines = [f"  attention: {calls['modules']} module(s) routed; {calls['reached']} call(s) took slimfit's "
                 f"core in {calls['forwards']} forward(s) with gradients"]
        reasons = Counter(why for _, why in calls["not_reached"])
        for why, count in sorted(reasons.items()):
            lines.append(f"  NOT REACHED {count:4d} x attention: {why}")
        return lines

    def __str__(self) -> str:
        lines = [f"slimfit patch (family: {self.family}); attention: {self.attention or 'left alone'}"]
        if not self.compresses_anything():
            lines.append(f"  {NOTHING_PATCHED}")
        # the model-wide SDPA router is reported by the attention line, with the calls it actually took
        listed = Counter(f"{kind}[{mode}]" for name, kind, mode in self.patched if name != "<sdpa>")
        for key, count in sorted(listed.items()):
            lines.append(f"  patched {count:4d} x {key}")
        lines += self._attention_lines()
        reasons = Counter((cls, reason) for _, cls, reason in self.skipped)
        for (cls, reason), count in sorted(reasons.items()):
            lines.append(f"  left    {count:4d} x {cls}: {reason}")
        return "\n".join(lines)
