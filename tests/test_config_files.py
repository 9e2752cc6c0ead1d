"""SlimFitConfig saved beside a checkpoint (slimfit_config.json) and loaded back."""
import dataclasses
import json

import pytest

from slimfit import AttentionSaving, LinearSampling, SlimFitConfig


@pytest.mark.parametrize("name", ["exact", "paper", "aggressive", "wta_crs"])
def test_round_trip_of_every_preset(tmp_path, name):
    config = SlimFitConfig.preset(name)
    path = config.save_pretrained(tmp_path / "ckpt")
    assert path.endswith("slimfit_config.json")
    loaded = SlimFitConfig.from_pretrained(tmp_path / "ckpt")
    assert loaded == config
    assert SlimFitConfig.from_pretrained(path) == config  # the file itself
    on_disk = json.loads(open(path).read())
    assert set(on_disk) == {f.name for f in dataclasses.fields(SlimFitConfig)}
    for part, cls in (("attention", AttentionSaving), ("sampling", LinearSampling)):  # the nested form
        assert on_disk[part] is None or set(on_disk[part]) == {f.name for f in dataclasses.fields(cls)}


def test_non_default_values_survive(tmp_path):
    config = SlimFitConfig.paper().replace(group_size=64, stochastic=True).with_attention(
        keep_ratio=0.25, path="materialize").with_sampling(method="crs", min_rows=3, norms="sample")
    config.save_pretrained(tmp_path)
    assert SlimFitConfig.from_pretrained(tmp_path) == config


def test_unknown_keys_and_bad_values_are_refused_by_name(tmp_path):
    values = SlimFitConfig.paper().to_dict()
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "slimfit_config.json").write_text(json.dumps({**values, "gelu_bitz": 4}))
    with pytest.raises(ValueError, match="gelu_bitz"):
        SlimFitConfig.from_pretrained(tmp_path / "a")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "slimfit_config.json").write_text(json.dumps({**values, "gelu_bits": 3}))
    with pytest.raises(ValueError, match="gelu_bits"):
        SlimFitConfig.from_pretrained(tmp_path / "b")
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "slimfit_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        SlimFitConfig.from_pretrained(tmp_path / "c")
    with pytest.raises(FileNotFoundError, match="slimfit_config.json"):
        SlimFitConfig.from_pretrained(tmp_path / "missing")
    with pytest.raises(TypeError, match="dict"):
        SlimFitConfig.from_dict([1, 2])
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "slimfit_config.json").write_text(json.dumps({**values, "attention": {"probz": "int8"}}))
    with pytest.raises(ValueError, match="SlimFitConfig.attention: unknown field.*probz"):
        SlimFitConfig.from_pretrained(tmp_path / "d")


# Files written by slimfit before the nested parts (flat fields), verbatim: paper(), exact() and wta_crs().
OLD_PAPER = (
    '{"attention": true, "attention_path": "auto", "attn_dropout_on_v": false, "attn_keep_ratio": 0.1, '
    '"attn_probs": "recompute", "check_finite": false, "dropout": "seed", "ffn_out_input_bits": 8, "gelu_bits": 4, '
    '"group_size": 128, "layernorm": "full", "layernorm_frozen": "int8", "layernorm_keep_ratio": 0.1, '
    '"linear_input_bits": null, "linear_sampling": null, "lm_head_chunk_rows": 256, "qkv_bits": 8, '
    '"sample_min_rows": 10, "sample_norms": "token", "sample_ratio": 0.3, "sample_targets": "paper", '
    '"silu_bits": 4, "stochastic": false}')
OLD_EXACT = (
    '{"attention": false, "attention_path": "auto", "attn_dropout_on_v": false, "attn_keep_ratio": 0.1, '
    '"attn_probs": "full", "check_finite": false, "dropout": "seed", "ffn_out_input_bits": null, "gelu_bits": null, '
    '"group_size": 128, "layernorm": "full", "layernorm_frozen": "full", "layernorm_keep_ratio": 0.1, '
    '"linear_input_bits": null, "linear_sampling": null, "lm_head_chunk_rows": null, "qkv_bits": null, '
    '"sample_min_rows": 10, "sample_norms": "token", "sample_ratio": 0.3, "sample_targets": "paper", '
    '"silu_bits": null, "stochastic": false}')
OLD_WTA_CRS = OLD_PAPER.replace('"linear_sampling": null', '"linear_sampling": "wta_crs"')


# paper() of that time kept a trained LayerNorm's x̂ in full (the files say so: they are read as written).
@pytest.mark.parametrize("text, expected", [(OLD_PAPER, SlimFitConfig.paper().replace(layernorm="full")),
                                            (OLD_EXACT, SlimFitConfig.exact()),
                                            (OLD_WTA_CRS, SlimFitConfig.wta_crs().replace(layernorm="full"))])
def test_old_flat_files_are_read(tmp_path, text, expected):
    (tmp_path / "slimfit_config.json").write_text(text)
    assert SlimFitConfig.from_pretrained(tmp_path) == expected


def test_old_flat_values_go_to_their_nested_fields():
    old = json.loads(OLD_WTA_CRS)
    old.update(qkv_bits=4, attn_probs="topk", attn_keep_ratio=0.25, attn_dropout_on_v=True,
               attention_path="materialize", linear_sampling="crs", sample_ratio=0.5, sample_min_rows=3,
               sample_targets="all", sample_norms="sample")
    config = SlimFitConfig.from_dict(old)
    assert config.attention == AttentionSaving(qkv_bits=4, probs="topk", keep_ratio=0.25, dropout_on_v=True,
                                               path="materialize")
    assert config.sampling == LinearSampling(method="crs", ratio=0.5, min_rows=3, targets="all", norms="sample")
    assert config.replace(attention=None, sampling=None) == SlimFitConfig.paper().replace(attention=None,
                                                                                          layernorm="full")
    assert SlimFitConfig.from_dict(config.to_dict()) == config


def test_old_flat_switches_off():
    old = json.loads(OLD_EXACT)
    # attention=False: the attention fields earlier versions accepted (and did not use) are dropped
    config = SlimFitConfig.from_dict({**old, "attention_path": "fused", "attn_keep_ratio": 0.5})
    assert config == SlimFitConfig.exact() and config.attention is None and config.sampling is None
    # ... and the ones they refused still are, by name
    with pytest.raises(ValueError, match="qkv_bits.*attention is off"):
        SlimFitConfig.from_dict({**old, "qkv_bits": 8})
    with pytest.raises(ValueError, match="sample_ratio.*sampling is off"):
        SlimFitConfig.from_dict({**old, "sample_ratio": 0.5})
    # files older still, without some of the flat fields: their defaults
    assert SlimFitConfig.from_dict({"attention": True, "attn_probs": "int8", "gelu_bits": 4}) == \
        SlimFitConfig(gelu_bits=4, attention=AttentionSaving(probs="int8"))
    assert SlimFitConfig.from_dict({"attention": False}) == SlimFitConfig()


def test_old_flat_form_is_checked_and_not_mixed_with_the_nested_one():
    old = json.loads(OLD_PAPER)
    with pytest.raises(ValueError, match="AttentionSaving.probs"):
        SlimFitConfig.from_dict({**old, "attn_probs": "int3"})
    with pytest.raises(ValueError, match="LinearSampling.method"):
        SlimFitConfig.from_dict({**old, "linear_sampling": "uniform"})
    nested = SlimFitConfig.paper().to_dict()
    with pytest.raises(ValueError, match="both 'attention' and.*attn_probs"):
        SlimFitConfig.from_dict({**nested, "attn_probs": "int8"})
    with pytest.raises(ValueError, match="both 'sampling' and.*linear_sampling"):
        SlimFitConfig.from_dict({**nested, "linear_sampling": "wta_crs"})
    with pytest.raises(ValueError, match="unknown field.*sample_ratioo"):
        SlimFitConfig.from_dict({**old, "sample_ratioo": 0.3})


def test_old_keywords_name_the_new_spelling():
    with pytest.raises(TypeError, match=r"qkv_bits is now attention.qkv_bits.*AttentionSaving\(qkv_bits=...\)"):
        SlimFitConfig(qkv_bits=8)
    with pytest.raises(TypeError, match=r"attn_probs is now attention.probs.*cfg.with_attention\(probs=...\)"):
        SlimFitConfig.paper().replace(attn_probs="int8")
    with pytest.raises(TypeError, match="attn_keep_ratio is now attention.keep_ratio"):
        SlimFitConfig.paper().replace(attn_keep_ratio=0.2)
    with pytest.raises(TypeError, match="attn_dropout_on_v is now attention.dropout_on_v"):
        SlimFitConfig(attn_dropout_on_v=True)
    with pytest.raises(TypeError, match=r"attention=True is now attention=AttentionSaving\(\)"):
        SlimFitConfig(attention=True)
    with pytest.raises(TypeError, match="attention=False is attention=None"):
        SlimFitConfig.paper().replace(attention=False)
    with pytest.raises(TypeError, match="AttentionSaving"):
        SlimFitConfig(attention={"probs": "int8"})


def test_part_validation_and_helpers():
    for bad, match in [(dict(qkv_bits=3), "AttentionSaving.qkv_bits"), (dict(qkv_bits=True), "qkv_bits"),
                       (dict(probs="int3"), "AttentionSaving.probs"), (dict(keep_ratio=0), "keep_ratio"),
                       (dict(keep_ratio=1.5), "keep_ratio"), (dict(dropout_on_v=1), "dropout_on_v"),
                       (dict(path="flash"), "AttentionSaving.path")]:
        with pytest.raises(ValueError, match=match):
            AttentionSaving(**bad)
    assert AttentionSaving(qkv_bits=2).qkv_bits == 2  # the attention core takes 2-bit Q/K/V
    paper = SlimFitConfig.paper()
    assert paper.with_attention(probs="int8") == paper.replace(
        attention=dataclasses.replace(paper.attention, probs="int8"))
    assert SlimFitConfig().with_attention() == SlimFitConfig(attention=AttentionSaving())
    with pytest.raises(TypeError, match="attn_probs"):
        paper.with_attention(attn_probs="int8")
    # the cross-field checks of the flat config are gone: a part off is simply None
    assert paper.replace(attention=None).attention is None
