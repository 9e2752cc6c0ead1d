"""WTA-CRS sampled weight gradients through slimfit.patch (config.sampling): targets, sample ids,
saved bytes, exact input gradients, unbiased weight gradients, training, state_dict, unpatch."""
import copy
import math
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import slimfit  # noqa: E402
from slimfit import LinearSampling, SlimFitConfig, memory  # noqa: E402
from slimfit.autograd import wta_crs as W  # noqa: E402
from slimfit.patching import norm_caches, sample_ids  # noqa: E402

from .tiny_models import BATCH, SEQ, build  # noqa: E402

SAMPLED = SlimFitConfig.exact().with_sampling(method="wta_crs", ratio=0.3)
IDS = torch.tensor([5, 17, 2])
ROWS = BATCH * SEQ
K = W.num_kept_rows(ROWS, 0.3, 10)  # 11 of 36 rows


def _patched(family="bert", config=SAMPLED):
    model, inputs = build(family)
    ref = copy.deepcopy(model)
    slimfit.patch(model, config)
    return model, ref, inputs


def _sampled_names(summary):
    return [name for name, kind, mode in summary.patched if kind == "linear" and "of rows" in mode]


# ------------------------------------------------------------------ config
@pytest.mark.parametrize("changes, match", [
    (dict(ratio=0.0), "LinearSampling.ratio must be a number in \\(0, 1\\]"),
    (dict(method="crs", ratio=1.5), "ratio"),
    (dict(method="crs", ratio=float("nan")), "ratio"),
    (dict(method="crs", ratio=True), "ratio"),
    (dict(min_rows=0), "LinearSampling.min_rows must be an int >= 1"),
    (dict(min_rows=2.5), "min_rows"),
    (dict(method="uniform"), "LinearSampling.method must be one of"),
    (dict(method=None), "LinearSampling.method must be one of"),
    (dict(targets="qkv"), "LinearSampling.targets must be one of"),
    (dict(norms="layer"), "LinearSampling.norms must be one of"),
])
def test_config_errors(changes, match):
    with pytest.raises(ValueError, match=match):
        LinearSampling(**changes)
    with pytest.raises(ValueError, match=match):
        SlimFitConfig.exact().with_sampling(**changes)


def test_preset_and_recipe():
    cfg = SlimFitConfig.wta_crs()
    assert cfg == SlimFitConfig.paper().replace(sampling=LinearSampling(method="wta_crs", ratio=0.3))
    assert cfg == SlimFitConfig.paper().with_sampling()  # the defaults are the preset's
    assert SlimFitConfig.preset("wta_crs") == cfg
    cfg = SlimFitConfig(sampling=LinearSampling(method="crs", ratio=1.0, min_rows=1, targets="all", norms="sample"))
    assert cfg.with_sampling(ratio=0.5).sampling == LinearSampling("crs", 0.5, 1, "all", "sample")
    assert cfg.replace(sampling=None) == SlimFitConfig()
    with pytest.raises(TypeError, match="LinearSampling"):
        SlimFitConfig(sampling="wta_crs")


# ------------------------------------------------------------------ targets
@pytest.mark.parametrize("family, expected", [
    ("bert", {"attention.output.dense", "intermediate.dense", "output.dense"}),
    ("distilbert", {"attention.out_lin", "ffn.lin1", "ffn.lin2"}),
    ("vit", {"attention.o_proj", "mlp.fc1", "mlp.fc2"}),
    ("gpt2", {"attn.c_proj", "mlp.c_fc", "mlp.c_proj"}),
    ("llama", {"self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}),
])
def test_family_targets_never_qkv(family, expected):
    model, _ = build(family)
    summary = slimfit.patch(model, SAMPLED).slimfit_summary
    names = _sampled_names(summary)
    assert len(names) == 2 * len(expected)  # two layers
    assert {n.split(".", 3 if family in ("bert", "distilbert") else 2)[-1].split(".", 1)[-1] for n in names} == expected
    assert len(norm_caches(model)) == len(names)


def test_generic_model_needs_all_targets():
    net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 2))
    summary = slimfit.patch(copy.deepcopy(net), SAMPLED).slimfit_summary
    assert not _sampled_names(summary)
    assert any(name == "<sampling>" and "targets='all'" in why for name, _, why in summary.skipped)
    summary = slimfit.patch(net, SAMPLED.with_sampling(targets="all")).slimfit_summary
    assert _sampled_names(summary) == ["0", "2"]


# ------------------------------------------------------------------ bytes and exact gradients
def test_saved_bytes_of_a_target_are_k_rows_plus_indices_and_weights():
    """docs/wta_crs.md: k·in·e + 4k (int32 indices) + 4k (fp32 weights); 8-bit rows: q(k·in, 8) + 8k."""
    model, ref, inputs = _patched("bert", SlimFitConfig.paper().with_sampling(method="wta_crs"))
    model.eval(), ref.eval()
    for n, p in model.named_parameters():  # only the targets of layer 0 train
        p.requires_grad_("layer.0." in n and ("output.dense" in n or "intermediate.dense" in n))
    run = memory.measure(model, **inputs, sample_ids=IDS)
    layer = "bert.encoder.layer.0."
    hidden, inter = 32, 64
    assert run.per_module[layer + "attention.output.dense"] == K * hidden * 4 + 8 * K
    assert run.per_module[layer + "intermediate.dense"] == K * hidden * 4 + 8 * K
    q8 = math.ceil(K * inter * 8 / 8) + 8 * math.ceil(K * inter / 128)
    assert run.per_module[layer + "output.dense"] == q8 + 8 * K  # FFN output projection: 8-bit in paper()
    full = memory.measure(ref, **inputs)
    assert full.per_module[layer + "intermediate.dense"] == ROWS * hidden * 4


def test_input_and_bias_gradients_exact_weight_gradient_sampled():
    model, ref, _ = _patched()
    dense, dense_ref = (m.bert.encoder.layer[0].intermediate.dense for m in (model, ref))
    x = torch.randn(BATCH, SEQ, 32, requires_grad=True)
    g = torch.randn(BATCH, SEQ, 64)
    with pytest.warns(UserWarning, match="without sample ids"):
        y = dense(x)
    assert torch.equal(y, dense_ref(x))
    with sample_ids(model, IDS):
        y = dense(x)
    got = torch.autograd.grad(y, [x, dense.weight, dense.bias], g)
    exact = torch.autograd.grad(dense_ref(x), [x, dense_ref.weight, dense_ref.bias], g)
    assert torch.equal(got[0], exact[0]) and torch.equal(got[2], exact[2])
    assert not torch.equal(got[1], exact[1])  # 11 of 36 rows: an estimate


def test_weight_gradient_unbiased_through_the_patched_module():
    """Mean of dW over 300 seeds vs the exact dW, judged by the estimator's exact variance V
    (p ∝ ‖x‖: no ids): projection z-score |z| <= 4 and ||mean - dW||² <= 10 V/n."""
    model, ref, _ = _patched()
    dense = model.bert.encoder.layer[0].intermediate.dense
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(BATCH, SEQ, 32, generator=gen) * torch.rand(BATCH, SEQ, 1, generator=gen)
    g = torch.randn(BATCH, SEQ, 64, generator=gen)
    x2, g2 = x.reshape(-1, 32).double(), g.reshape(-1, 64).double()
    exact = g2.t().mm(x2)
    n = 300
    samples = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # no ids on purpose
        for seed in range(n):
            torch.manual_seed(seed)
            samples.append(torch.autograd.grad(dense(x), dense.weight, g)[0].double())
    samples = torch.stack(samples)
    p = W.sampling_probabilities(x2.norm(dim=1).float()).double()
    mean = samples.mean(0)
    d = exact / exact.norm()
    z = float(((mean - exact) * d).sum()) / math.sqrt(W.projected_variance(x2, g2, p, K, "wta_crs", d) / n)
    frob = float(((mean - exact) ** 2).sum()) / (W.expected_sq_error(x2, g2, p, K, "wta_crs") / n)
    assert abs(z) <= 4.0, z
    assert frob <= 10.0, frob


def test_frozen_target_takes_the_fast_path():
    model, _, inputs = _patched()
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    model.bert.embeddings.word_embeddings.weight.requires_grad_(True)  # gradients flow, targets frozen
    run = memory.measure(model, **inputs, sample_ids=IDS)
    assert all(run.per_module.get(f"bert.encoder.layer.{i}.intermediate.dense", 0) == 0 for i in range(2))
    assert all(c.capacity == 0 for c in norm_caches(model).values())  # no sampling, no cache update


# ------------------------------------------------------------------ sample ids
def test_sample_ids_keyword_and_context_manager_fill_the_caches():
    model, _, inputs = _patched()
    model.train()
    model(**inputs, sample_ids=IDS).loss.backward()
    caches = norm_caches(model)
    assert all(c.num_seen() == BATCH for c in caches.values())
    cache = caches["bert.encoder.layer.1.output.dense"]
    assert torch.isfinite(cache.lookup(IDS, SEQ)).all()
    with sample_ids(model, [40, 41, 42]):
        model(**inputs).loss.backward()
    assert all(c.num_seen() == 2 * BATCH for c in caches.values())
    assert not hasattr(slimfit.patch, "sample_ids")  # a function carries no attributes: slimfit.patching.sample_ids


def test_warns_once_without_ids_and_on_mismatched_ids():
    model, _, inputs = _patched()
    model.train()
    with pytest.warns(UserWarning, match="without sample ids") as record:
        model(**inputs).loss.backward()
        model(**inputs).loss.backward()
    assert sum("without sample ids" in str(r.message) for r in record) == 1
    with pytest.warns(UserWarning, match="2 sample ids for a batch of 3"):
        model(**inputs, sample_ids=[1, 2]).loss.backward()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # with ids: silent
        model(**inputs, sample_ids=IDS).loss.backward()


def test_sample_ids_need_a_patched_model():
    with pytest.raises(RuntimeError, match="not patched"):
        with sample_ids(torch.nn.Linear(2, 2), [0]):
            pass
    model, _ = build("bert")
    slimfit.patch(model, SlimFitConfig.exact())
    with sample_ids(model, [0, 1, 2]):  # no sampling configured: nothing reads them
        pass


# ------------------------------------------------------------------ training, state, unpatch
def _train(model, inputs, steps=20, ids=None):
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    losses = []
    for _ in range(steps):
        extra = {} if ids is None else {"sample_ids": ids}
        loss = model(**inputs, **extra).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("family", ["bert", "gpt2"])
def test_trains_like_plain(family):
    model, ref, inputs = _patched(family, SlimFitConfig.wta_crs())
    plain = _train(ref, inputs)
    slim = _train(model, inputs, ids=IDS)
    drop_plain, drop_slim = plain[0] - min(plain[-5:]), slim[0] - min(slim[-5:])
    assert drop_plain > 0 and drop_slim > 0
    assert drop_slim >= 0.7 * drop_plain, (plain, slim)


def test_state_dict_unchanged_and_unpatch_restores():
    model, ref, inputs = _patched()
    assert model.state_dict().keys() == ref.state_dict().keys()
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values()))
    model.train()
    model(**inputs, sample_ids=IDS).loss.backward()
    assert model.state_dict().keys() == ref.state_dict().keys()  # caches are not state
    slimfit.unpatch(model)
    assert not norm_caches(model)
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert {n: type(m) for n, m in model.named_modules()} == {n: type(m) for n, m in ref.named_modules()}


def test_deep_copy_of_a_patched_model_feeds_its_own_layers():
    model, _, inputs = _patched()
    twin = copy.deepcopy(model)
    twin.train()
    twin(**inputs, sample_ids=IDS).loss.backward()
    assert all(c.num_seen() == BATCH for c in norm_caches(twin).values())
    assert all(c.num_seen() == 0 for c in norm_caches(model).values())
    slimfit.unpatch(twin)
    # the original keeps its root hooks (sample ids, generator advance, added-module check)
    assert not twin._forward_pre_hooks and len(model._forward_pre_hooks) == 3


def test_scheduler_composes():
    from slimfit.scheduler import ILSScheduler

    model, _, inputs = _patched()
    sched = ILSScheduler(model, freeze_rate=0.5, warmup_steps=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched.attach_optimizer(opt)
    model.train()
    for _ in range(3):
        model(**inputs, sample_ids=IDS).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()


def test_lora_samples_lora_a_of_targets_only():
    peft = pytest.importorskip("peft")
    model, inputs = build("bert")
    cfg = peft.LoraConfig(r=4, target_modules=["query", "dense"], lora_dropout=0.0)
    lora = peft.get_peft_model(model, cfg)
    summary = slimfit.patch(lora, SAMPLED).slimfit_summary
    names = _sampled_names(summary)
    assert names and all(n.endswith((".lora_A.default", ".base_layer")) for n in names)
    assert not any(".query." in n for n in names)  # Q is never a target
    assert any(n.endswith("intermediate.dense.lora_A.default") for n in names)
    lora.train()
    lora(**inputs, sample_ids=IDS).loss.backward()
    a = lora.get_submodule("base_model.model.bert.encoder.layer.0.intermediate.dense.lora_A.default")
    assert a.weight.grad is not None and torch.isfinite(a.weight.grad).all()
