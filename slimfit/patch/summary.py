"""What a patch did: which modules were patched with which mode, which were left alone and why."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class PatchSummary:
    family: str
    patched: list = field(default_factory=list)  # (module name, kind, mode)
    skipped: list = field(default_factory=list)  # (module name, class name, reason)
    attention: str | None = None  # attention implementation set on the model, if any
    notes: tuple = ()  # the family's notes (Family.notes): what its patch does beyond the generic one

    def counts(self) -> dict:
        return dict(Counter(f"{kind}[{mode}]" for _, kind, mode in self.patched))

    def __str__(self) -> str:
        lines = [f"slimfit patch (family: {self.family}); attention: {self.attention or 'left alone'}"]
        for key, count in sorted(self.counts().items()):
            lines.append(f"  patched {count:4d} x {key}")
        reasons = Counter((cls, reason) for _, cls, reason in self.skipped)
        for (cls, reason), count in sorted(reasons.items()):
            lines.append(f"  left    {count:4d} x {cls}: {reason}")
        return "\n".join(lines)
