"""One base under both configs (slimfit/_config_base.py): the saved form (format version, JSON file beside a
checkpoint) and the checks' error style are the same for SlimFitConfig and SchedulerConfig, and a file saved
in the format both write loads as it did."""
import ast
import json
import pathlib

import pytest

import slimfit
from slimfit import SlimFitConfig
from slimfit._config_base import ConfigBase
from slimfit.scheduler import SchedulerConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]

# SlimFitConfig.paper() as slimfit_config.json holds it (format version 1).
PAPER_FILE = {"attention": {"dropout_on_v": False, "keep_ratio": 0.1, "path": "auto", "probs": "recompute",
                            "qkv_bits": 8},
              "check_finite": False, "dropout": "seed", "ffn_out_input_bits": 8, "gelu_bits": 4, "group_size": 128,
              "layernorm": "int8", "layernorm_frozen": "int8", "layernorm_keep_ratio": 0.1, "linear_input_bits": None,
              "lm_head_chunk_rows": 256, "sampling": None, "silu_bits": 4, "stochastic": False, "version": 1}


def test_both_configs_share_the_base_and_its_file_handling(tmp_path):
    for config, name in ((SlimFitConfig.paper(), "slimfit_config.json"),
                         (SchedulerConfig(freeze_rate=0.5), "slimfit_scheduler.json")):
        cls = type(config)
        assert isinstance(config, ConfigBase) and cls.CONFIG_NAME == name and cls.CONFIG_VERSION == 1
        path = config.save_pretrained(tmp_path / cls.__name__)
        assert pathlib.Path(path).name == name
        text = pathlib.Path(path).read_text()
        assert text == json.dumps(config.to_dict(), indent=2, sort_keys=True) + "\n"
        assert cls.from_pretrained(tmp_path / cls.__name__) == config
        assert cls.from_pretrained(path) == config


def test_a_saved_file_loads_as_it_did(tmp_path):
    assert SlimFitConfig.paper().to_dict() == PAPER_FILE
    (tmp_path / "slimfit_config.json").write_text(json.dumps(PAPER_FILE))
    assert SlimFitConfig.from_pretrained(tmp_path) == SlimFitConfig.paper()
    assert SlimFitConfig.from_pretrained(tmp_path, gelu_bits=8) == SlimFitConfig.paper().replace(gelu_bits=8)


@pytest.mark.parametrize("cls", [SlimFitConfig, SchedulerConfig])
def test_one_version_rule(cls):
    values = cls().to_dict()
    with pytest.raises(ValueError, match=rf"{cls.__name__}.from_dict: format version 2 is not one this slimfit "
                                         r"reads \(1\)"):
        cls.from_dict({**values, "version": 2})
    with pytest.raises(ValueError, match="format version '1'"):
        cls.from_dict({**values, "version": "1"})
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['nope'\]"):
        cls.from_dict({**values, "nope": 1})
    assert cls.from_dict({k: v for k, v in values.items() if k != "version"}) == cls()


def test_slimfit_config_errors_in_the_scheduler_style():
    with pytest.raises(ValueError, match=r"SlimFitConfig.layernorm must be one of .*got str 'ful'; "
                                         r"did you mean 'full'\?"):
        SlimFitConfig(layernorm="ful")
    with pytest.raises(ValueError, match=r"AttentionSaving.keep_ratio must be a number in \(0, 1\].*"
                                         r"pass the number itself, not a string: keep_ratio=0.5"):
        slimfit.AttentionSaving(keep_ratio="0.5")
    with pytest.raises(ValueError, match=r"SchedulerConfig.score must be one of .*did you mean 'relative'\?"):
        SchedulerConfig(score="relativ")
    with pytest.raises(ValueError, match="SlimFitConfig.gelu_bits must be one of"):
        SlimFitConfig(gelu_bits=True)
    assert SlimFitConfig(gelu_bits=8.0).gelu_bits == 8   # a float that equals an allowed value is one


def test_the_base_is_pure_python():
    """The scheduler imports the base: it must not pull in torch, the patch layer or slimfit.config."""
    tree = ast.parse((ROOT / "slimfit" / "_config_base.py").read_text())
    names = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
             for alias in node.names}
    names |= {(node.module or "").split(".")[0] for node in ast.walk(tree)
              if isinstance(node, ast.ImportFrom) and node.level == 0}
    assert names <= {"__future__", "difflib", "json", "math", "numbers", "os", "typing"}, names
    assert not any(isinstance(node, ast.ImportFrom) and node.level for node in ast.walk(tree))
