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
    assert set(on_disk) == {f.name for f in dataclasses.fields(SlimFitConfig)} | {"version"}
    from slimfit.config import ExperimentalSaving

    for part, cls in (("attention", AttentionSaving), ("sampling", LinearSampling),
                      ("experimental", ExperimentalSaving)):  # the nested form
        assert on_disk[part] is None or set(on_disk[part]) == {f.name for f in dataclasses.fields(cls)}


def test_non_default_values_survive(tmp_path):
    config = SlimFitConfig.paper().replace(group_size=64, stochastic=True).with_attention(
        path="materialize").with_sampling(method="crs", min_rows=3, norms="sample").with_experimental(
        topk_norms="frozen", keep_ratio=0.25, dropout_on_v=True)
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


def test_format_version_is_saved_and_checked(tmp_path):
    values = SlimFitConfig.paper().to_dict()
    assert values["version"] == 2
    assert SlimFitConfig.from_dict({k: v for k, v in values.items() if k != "version"}) == SlimFitConfig.paper()
    with pytest.raises(ValueError, match="format version 3"):
        SlimFitConfig.from_dict({**values, "version": 3})


def test_flat_fields_are_unknown_fields_named():
    with pytest.raises(ValueError, match="unknown field.*attn_probs"):
        SlimFitConfig.from_dict({**SlimFitConfig.paper().to_dict(), "attn_probs": "int8"})
    with pytest.raises(TypeError, match="qkv_bits"):
        SlimFitConfig(qkv_bits=8)


def test_part_as_bool_or_dict_names_the_fix():
    with pytest.raises(TypeError, match=r"attention=True is now attention=AttentionSaving\(\)"):
        SlimFitConfig(attention=True)
    with pytest.raises(TypeError, match="attention=False is attention=None"):
        SlimFitConfig.paper().replace(attention=False)
    with pytest.raises(TypeError, match="AttentionSaving"):
        SlimFitConfig(attention={"probs": "int8"})


def test_part_validation_and_helpers():
    for bad, match in [(dict(qkv_bits=3), "AttentionSaving.qkv_bits"), (dict(qkv_bits=True), "qkv_bits"),
                       (dict(probs="int3"), "AttentionSaving.probs"), (dict(probs="topk"), "experimental"),
                       (dict(path="flash"), "AttentionSaving.path")]:
        with pytest.raises(ValueError, match=match):
            AttentionSaving(**bad)
    from slimfit.config import ExperimentalSaving

    for bad, match in [(dict(keep_ratio=0), "keep_ratio"), (dict(keep_ratio=1.5), "keep_ratio"),
                       (dict(dropout_on_v=1), "dropout_on_v"), (dict(topk_probs=1), "topk_probs"),
                       (dict(topk_norms="both"), "topk_norms")]:
        with pytest.raises(ValueError, match=match):
            ExperimentalSaving(**bad)
    with pytest.raises(ValueError, match="attention=AttentionSaving"):   # top-k of P needs the attention core
        SlimFitConfig(experimental=ExperimentalSaving(topk_probs=True))
    assert AttentionSaving(qkv_bits=2).qkv_bits == 2  # the attention core takes 2-bit Q/K/V
    paper = SlimFitConfig.paper()
    assert paper.with_attention(probs="int8") == paper.replace(
        attention=dataclasses.replace(paper.attention, probs="int8"))
    assert SlimFitConfig().with_attention() == SlimFitConfig(attention=AttentionSaving())
    with pytest.raises(TypeError, match="attn_probs"):
        paper.with_attention(attn_probs="int8")
    # the cross-field checks of the flat config are gone: a part off is simply None
    assert paper.replace(attention=None).attention is None
