"""SchedulerConfig: every option validated once, by name, with the fix; ILSScheduler(model, config,
optimizer, **options) with the keywords as a shorthand; the experimental options kept apart; the config
saved beside a checkpoint (to_dict / from_dict / save_pretrained / from_pretrained, with a version)."""
import dataclasses
import inspect
import json

import pytest
import torch
from _models import MLP, regression_data
from torch import nn

import slimfit
from slimfit.scheduler import ExperimentalOptions, ILSScheduler, SchedulerConfig

# (options, the field the error names, a word of the fix or of the rule). Each was accepted silently before
# SchedulerConfig, or failed later with an error that did not name the option (freeze_rate="0.9": TypeError
# "'<=' not supported between instances of 'float' and 'str'").
BAD_OPTIONS = [
    (dict(freeze_rate="0.9"), "freeze_rate", r"not a string: freeze_rate=0\.9"),
    (dict(freeze_rate=True), "freeze_rate", "bool, not a number"),
    (dict(freeze_rate=float("nan")), "freeze_rate", "got float nan"),
    (dict(freeze_rate=None), "freeze_rate", "NoneType"),
    (dict(seed=True), "seed", "bool, not a number"),
    (dict(seed=1.5), "seed", "got float 1.5"),
    (dict(seed="0"), "seed", "not a string"),
    (dict(min_trained_steps=True), "min_trained_steps", "bool, not a number"),
    (dict(min_frozen_steps=False), "min_frozen_steps", "bool, not a number"),
    (dict(chunk_numel=True), "chunk_numel", "bool, not a number"),
    (dict(chunk_numel=2.0**20), "chunk_numel", "int >= 1"),
    (dict(memory_aware=1, activation_bytes={}), "memory_aware", "True or False"),
    (dict(distributed=1), "distributed", "None, True or False"),
    (dict(base_bytes=float("nan")), "base_bytes", "finite"),
    (dict(base_bytes=-1), "base_bytes", ">= 0"),
    (dict(base_bytes="10"), "base_bytes", "not a string"),
    (dict(budget_bytes=True, activation_bytes={}), "budget_bytes", "bool, not a number"),
    (dict(budget_bytes=float("inf"), activation_bytes={}), "budget_bytes", "finite"),
    (dict(release_state_after=True), "release_state_after", "bool, not a number"),
    (dict(activation_bytes={"fc1.weight": float("nan")}), r"activation_bytes\['fc1.weight'\]", "finite"),
    (dict(activation_bytes={"fc1.weight": "12"}), r"activation_bytes\['fc1.weight'\]", "finite"),
    (dict(activation_bytes=[1, 2]), "activation_bytes", "estimate_activation_bytes"),
    (dict(score="relativ"), "score", "did you mean 'relative'"),
    (dict(rounding="flor"), "rounding", "did you mean 'floor'"),
    (dict(scheduled_kinds="matmull"), "scheduled_kinds", "did you mean 'matmul'"),
    (dict(scheduled_kinds=[1]), "scheduled_kinds", "non-empty selection"),
    (dict(min_train_share="evne"), "min_train_share", "did you mean 'even'"),
    (dict(min_train_share=0.5, freeze_rate=0.9), "min_train_share", "lower min_train_share or freeze_rate"),
    (dict(always_train=[3]), "always_train", "module names"),
    (dict(layers="fc1.weight"), "layers", r"layers=\['"),
    (dict(layers=[("fc1.weight", 3)]), "layers", "named_parameters"),
    (dict(frozen_update="momentom"), "frozen_update", "did you mean 'momentum'"),
    (dict(update_scale="shar"), "update_scale", "did you mean 'share'"),
    (dict(warmup_steps=2.0), "warmup_steps", "int >= 0"),
    (dict(warmup_steps="aut"), "warmup_steps", "or 'auto'"),
    (dict(warmup_steps=True), "warmup_steps", "bool, not a number"),
    (dict(warmup_start_rate=1.0), "warmup_start_rate", r"in \[0, 1\)"),
    (dict(process_group=object(), distributed=False), "process_group", "distributed=False"),
]


@pytest.mark.parametrize("options,name,fix", BAD_OPTIONS, ids=[str(o) for o, _, _ in BAD_OPTIONS])
def test_a_bad_option_is_named_with_its_fix(options, name, fix):
    experimental = ("frozen_update", "warmup_start_rate")
    owner = r"ExperimentalOptions" if name in experimental else "SchedulerConfig"
    pattern = rf"{owner}\.{name} must be .*{fix}"
    with pytest.raises(ValueError, match=pattern):
        ILSScheduler(MLP(), **options)
    with pytest.raises(ValueError, match=pattern):
        SchedulerConfig.from_options(**options)


def test_a_bad_option_fails_before_the_model_is_touched():
    model = MLP()
    with pytest.raises(ValueError):
        ILSScheduler(model, freeze_rate="0.9")
    assert all(p.requires_grad for p in model.parameters())
    assert not model._forward_pre_hooks          # no pending hook left behind
    model(regression_data()[0])
    assert all(p.requires_grad for p in model.parameters())


def test_unknown_keyword_names_the_valid_ones():
    with pytest.raises(TypeError, match=r"'freez_rate' \(did you mean 'freeze_rate'\?\); the options are .*seed"):
        ILSScheduler(MLP(), freez_rate=0.5)
    with pytest.raises(TypeError, match="the options are the fields of SchedulerConfig"):
        SchedulerConfig().replace(nonsense=1)


def test_init_takes_model_config_optimizer_and_options():
    params = inspect.signature(ILSScheduler.__init__).parameters
    assert len(params) <= 5
    assert list(params)[:4] == ["self", "model_or_named_params", "config", "optimizer"]
    assert params["options"].kind is inspect.Parameter.VAR_KEYWORD


def test_config_and_shorthand_build_the_same_scheduler():
    x, y = regression_data()
    runs = []
    for build in (lambda m, o: ILSScheduler(m, freeze_rate=0.6, seed=3, min_trained_steps=1, optimizer=o),
                  lambda m, o: ILSScheduler(m, SchedulerConfig(freeze_rate=0.6, seed=3, min_trained_steps=1), o),
                  lambda m, o: ILSScheduler(m, 0.6, optimizer=o, seed=3, min_trained_steps=1)):
        torch.manual_seed(0)
        model = MLP()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        sched = build(model, opt)
        log = []
        for _ in range(6):
            log.append(tuple(sched.frozen_names()))
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            sched.step()
        runs.append(log)
        assert sched.config == SchedulerConfig(freeze_rate=0.6, seed=3, min_trained_steps=1)
    assert runs[0] == runs[1] == runs[2]


def test_config_with_options_merges_them():
    base = SchedulerConfig(freeze_rate=0.5, seed=1)
    sched = ILSScheduler(MLP(), base, seed=7, frozen_update="momentum")
    assert sched.config == base.replace(seed=7, frozen_update="momentum")
    assert (sched.config.freeze_rate, sched.config.seed) == (0.5, 7)
    assert base.seed == 1                                   # the given config is not changed
    with pytest.raises(TypeError, match="given twice"):
        ILSScheduler(MLP(), 0.5, freeze_rate=0.6)
    with pytest.raises(TypeError, match="config must be a SchedulerConfig or a freeze rate"):
        ILSScheduler(MLP(), "0.9")
    with pytest.raises(TypeError, match="third argument is the optimizer.*score='robust'"):
        ILSScheduler(MLP(), 0.5, "robust")


def test_the_config_is_frozen_and_set_freeze_rate_replaces_it():
    sched = ILSScheduler(MLP(), 0.5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        sched.config.freeze_rate = 0.9
    sched.set_freeze_rate(0.8)
    assert sched.config.freeze_rate == sched.freeze_rate == 0.8
    with pytest.raises(ValueError, match="SchedulerConfig.freeze_rate must be in"):
        sched.set_freeze_rate("0.9")
    assert sched.freeze_rate == 0.8


def test_experimental_options_live_apart_and_the_shorthand_reaches_them():
    sched = ILSScheduler(MLP(), 0.6, frozen_update="momentum", warmup_start_rate=0.3, score="absolute")
    cfg = sched.config
    assert cfg.experimental == ExperimentalOptions(frozen_update="momentum", warmup_start_rate=0.3, score="absolute")
    assert cfg.score == "relative" and cfg.effective_score == "absolute"
    assert cfg.replace(score="robust").effective_score == "robust"   # a main score replaces it
    main = {f.name for f in dataclasses.fields(SchedulerConfig)}
    assert not {"frozen_update", "warmup_start_rate"} & main and {"update_scale", "warmup_steps"} <= main
    with pytest.raises(ValueError, match="score='absolute' is experimental.*ExperimentalOptions"):
        SchedulerConfig(score="absolute")
    with pytest.raises(ValueError, match="not experimental"):
        ExperimentalOptions(score="robust")
    with pytest.raises(ValueError, match="two scores"):
        SchedulerConfig(score="robust", experimental=ExperimentalOptions(score="absolute"))
    with pytest.raises(TypeError, match="ExperimentalOptions"):
        SchedulerConfig(experimental={"frozen_update": "momentum"})


def test_to_dict_from_dict_and_files_round_trip(tmp_path):
    cfg = SchedulerConfig(freeze_rate=0.5, scheduled_kinds=["norm", "matmul"], always_train=["head"],
                          activation_bytes={"fc1.weight": 10}, budget_bytes=100.0, min_train_share="even",
                          layers=["fc1.weight", "fc2.weight"]).replace(warmup_steps=2, score="absolute")
    assert cfg.scheduled_kinds == ("matmul", "norm")         # normalised: same config, same spelling
    d = cfg.to_dict()
    assert d["version"] == slimfit.scheduler.config.CONFIG_VERSION and d["experimental"]["score"] == "absolute"
    assert json.loads(json.dumps(d)) == d
    assert SchedulerConfig.from_dict(d) == cfg
    assert SchedulerConfig.from_dict(cfg.to_dict(nested=False)) == cfg
    path = cfg.save_pretrained(tmp_path)
    assert path.endswith("slimfit_scheduler.json")
    assert SchedulerConfig.from_pretrained(tmp_path) == cfg
    assert SchedulerConfig.from_pretrained(tmp_path, seed=4) == cfg.replace(seed=4)


def test_from_dict_refuses_what_it_cannot_read(tmp_path):
    d = SchedulerConfig().to_dict()
    with pytest.raises(ValueError, match="version 2 is not one this slimfit reads"):
        SchedulerConfig.from_dict({**d, "version": 2})
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['freeze'\]"):
        SchedulerConfig.from_dict({**d, "freeze": 0.5})
    with pytest.raises(ValueError, match="unknown experimental field"):
        SchedulerConfig.from_dict({**d, "experimental": {"momentum": True}})
    with pytest.raises(ValueError, match="SchedulerConfig.freeze_rate must be in"):
        SchedulerConfig.from_dict({**d, "freeze_rate": "0.9"})
    (tmp_path / "slimfit_scheduler.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        SchedulerConfig.from_pretrained(tmp_path)


def test_objects_of_the_process_are_not_saved_but_asked_for_again():
    def per_layer(name, param):
        return 4 * param.shape[-1]

    cfg = SchedulerConfig(activation_bytes=per_layer, budget_bytes=1e6)
    d = cfg.to_dict()
    assert json.loads(json.dumps(d)) == d
    with pytest.raises(ValueError, match=r"\['activation_bytes'\] held an object.*activation_bytes=\.\.\."):
        SchedulerConfig.from_dict(d)
    assert SchedulerConfig.from_dict(d, activation_bytes=per_layer) == cfg


def test_layer_pairs_compare_by_identity_and_save_as_names():
    model = MLP()
    pairs = [("fc1.weight", model.fc1.weight)]
    cfg = SchedulerConfig(layers=pairs)
    assert cfg == SchedulerConfig(layers=pairs) and hash(cfg) == hash(SchedulerConfig(layers=pairs))
    assert cfg != SchedulerConfig(layers=[("fc1.weight", MLP().fc1.weight)])
    assert cfg.to_dict()["layers"] == ["fc1.weight"]
    assert "Parameter" not in repr(cfg) and "fc1.weight" in repr(cfg)
    assert ILSScheduler(model, cfg).names == ["fc1.weight"]


def test_state_dict_saves_the_options_flat():
    sched = ILSScheduler(MLP(), 0.6, update_scale="share", score="absolute", activation_bytes={"fc1.weight": 1})
    saved = sched.state_dict()["config"]
    assert saved["update_scale"] == "share" and saved["score"] == "absolute"
    assert saved["scheduled_kinds"] == ["matmul"]           # as resolved against the model
    assert "activation_bytes" not in saved and "version" not in saved
    assert SchedulerConfig.from_dict(saved).update_scale == "share"


def test_a_config_saved_while_update_scale_was_experimental_loads():
    saved = SchedulerConfig(update_scale="share").to_dict()
    saved["experimental"]["update_scale"] = saved.pop("update_scale")   # the nested form of that time
    assert SchedulerConfig.from_dict(saved).update_scale == "share"


def test_exported_at_the_top():
    assert slimfit.SchedulerConfig is SchedulerConfig
    assert "SchedulerConfig" in slimfit.__all__ and "SchedulerConfig" in slimfit.scheduler.__all__


def test_every_field_is_checked_once_in_post_init():
    from slimfit.scheduler import config as C

    init_fields = [f.name for f in dataclasses.fields(SchedulerConfig) if f.init]
    assert list(C._CHECKS) == init_fields                    # one check per field, in field order
    assert SchedulerConfig().version == C.CONFIG_VERSION
    with pytest.raises(TypeError):
        SchedulerConfig(version=2)                          # set by slimfit, not an argument


def test_warmup_steps_auto_ramps_a_causal_lm_only():
    """warmup_steps="auto" (the default): a causal LM's rate ramps from 0 over DECODER_WARMUP_STEPS; any other
    model, or bare parameters, freeze at the rate from the first step."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from slimfit.scheduler.config import DECODER_WARMUP_STEPS

    llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=2))
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=32))
    for model in (llama, gpt2):
        sched = ILSScheduler(model, 0.7)
        assert sched.config.warmup_steps == "auto" and sched.warmup_steps == DECODER_WARMUP_STEPS
        assert sched.num_frozen == 0 and sched.current_rate() == 0.0   # nothing frozen at the first step
        assert ILSScheduler(model, 0.7, warmup_steps=0).num_frozen > 0
    encoder = ILSScheduler(MLP(), 0.5)
    assert encoder.warmup_steps == 0 and encoder.num_frozen > 0
    bare = ILSScheduler(list(llama.named_parameters()), 0.7)
    assert bare.warmup_steps == 0


def test_a_config_saved_before_auto_warmup_freezes_from_the_first_step():
    old = SchedulerConfig(freeze_rate=0.5).to_dict()
    del old["warmup_steps"]
    assert SchedulerConfig.from_dict(old).warmup_steps == 0
    nested = {**old, "experimental": {**old["experimental"], "warmup_steps": 7}}   # saved when experimental
    assert SchedulerConfig.from_dict(nested).warmup_steps == 7
