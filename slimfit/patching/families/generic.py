"""Class knowledge of no one family: transformers activations slimfit must not treat as GELU.
`model_types` is empty, so no model is of this family (models it does not know get the generic patch)."""
from . import Family

FAMILY = Family(
    name="generic",
    model_types=(),
    not_compressed=(
        ("QuickGELUActivation", "QuickGELU is not GELU (saved as in PyTorch)"),
        ("FastGELUActivation", "FastGELU's formula differs from GELU (saved as in PyTorch)"),
    ),
)
