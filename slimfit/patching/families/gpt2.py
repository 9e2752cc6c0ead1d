"""GPT-2: Conv1D layers (x @ W + b) routed through slimfit's linear; gelu_new (tanh) activation."""
from . import Family

FAMILY = Family(
    name="gpt2",
    model_types=("gpt2",),
    ffn_out_suffixes=(".mlp.c_proj",),
    notes=("Conv1D weights are (in, out): the linear sees W.t()",),
    # c_attn (the fused Q/K/V projection) is not sampled
    sampled_suffixes=(".attn.c_proj", ".mlp.c_fc", ".mlp.c_proj"),
)
