"""Vision transformers: ViT and DeiT (ViTLayer.output.dense after intermediate GELU) and
DINOv2 (Dinov2Layer.mlp.fc2). The patch-embedding Conv2d is left alone (a frozen conv
still saves its input; it is a small share of the activations)."""
from . import Family

FAMILY = Family(
    name="vit",
    model_types=("vit", "deit", "dinov2"),
    ffn_out_suffixes=(".output.dense", ".mlp.fc2"),
    notes=("patch-embedding Conv2d left alone", "DINOv2 layer scale left alone"),
)
