"""SlimFitConfig saved beside a checkpoint (slimfit_config.json) and loaded back."""
import dataclasses
import json

import pytest

from slimfit import SlimFitConfig


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


def test_non_default_values_survive(tmp_path):
    config = SlimFitConfig.paper().replace(group_size=64, stochastic=True, attn_keep_ratio=0.25)
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
