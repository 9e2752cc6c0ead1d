"""Vision transformers: ViT and DeiT (FFN output projection: ViTLayer.output.dense in transformers 4,
.mlp.fc2 in transformers 5) and DINOv2 (Dinov2Layer.mlp.fc2).

The patch-embedding Conv2d takes the frozen fast path (slimfit.autograd.conv): with its weight frozen
it saves nothing -- PyTorch keeps the whole batch of pixel values for it whenever its bias trains --
and with a trainable weight it is PyTorch's conv. WTA-CRS targets: the attention output projection
and the two FFN linears (transformers 4 and 5 names), never Q/K/V."""
from . import Family

FAMILY = Family(
    name="vit",
    model_types=("vit", "deit", "dinov2"),
    ffn_out_suffixes=(".output.dense", ".mlp.fc2"),
    notes=("patch-embedding Conv2d: frozen fast path (0 bytes when frozen)", "DINOv2 layer scale left alone"),
    sampled_suffixes=(".attention.output.dense", ".intermediate.dense", ".output.dense",
                      ".attention.o_proj", ".mlp.fc1", ".mlp.fc2"),
)
