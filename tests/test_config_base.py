"""One base under both configs (slimfit/_config_base.py): the saved form (format version, JSON file beside a
checkpoint) and the checks' error style are the same for SlimFitConfig and SchedulerConfig, and a file saved
in the format both write loads as it did."""
import ast
import json
import pathlib

import pytest

from slimfit import SlimFitConfig
from slimfit._config_base import ConfigBase
from slimfit.scheduler import SchedulerConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]

# SlimFitConfig.paper() as slimfit_config.json holds it (format version 2), and as version 1 wrote it (top-k
# and dropout on V among the main fields).
PAPER_FILE = {"attention": {"path": "auto", "probs": "recompute", "qkv_bits": 8},
              "check_finite": False, "dropout": "seed", "ffn_out_input_bits": 8, "gelu_bits": 4, "group_size": 128,
              "layernorm": "int8", "layernorm_frozen": "int8", "linear_input_bits": None,
              "lm_head_chunk_rows": 256, "sampling": None, "silu_bits": 4, "stochastic": False,
              "experimental": {"topk_norms": "none", "topk_probs": False, "keep_ratio": 0.1, "dropout_on_v": False},
              "version": 2}
PAPER_FILE_V1 = {"attention": {"dropout_on_v": False, "keep_ratio": 0.1, "path": "auto", "probs": "recompute",
                               "qkv_bits": 8},
                 "check_finite": False, "dropout": "seed", "ffn_out_input_bits": 8, "gelu_bits": 4, "group_size": 128,
                 "layernorm": "int8", "layernorm_frozen": "int8", "layernorm_keep_ratio": 0.1,
                 "linear_input_bits": None, "lm_head_chunk_rows": 256, "sampling": None, "silu_bits": 4,
                 "stochastic": False, "version": 1}


def test_both_configs_share_the_base_and_its_file_handling(tmp_path):
    for config, name in ((SlimFitConfig.paper(), "slimfit_config.json"),
                         (SchedulerConfig(freeze_rate=0.5), "slimfit_scheduler.json")):
        cls = type(config)
        assert isinstance(config, ConfigBase) and cls.CONFIG_NAME == name
        assert cls.CONFIG_VERSION == {"SlimFitConfig": 2, "SchedulerConfig": 1}[cls.__name__]
        path = config.save_pretrained(tmp_path / cls.__name__)
        assert pathlib.Path(path).name == name
        text = pathlib.Path(path).read_text()
        assert text == json.dumps(config.to_dict(), indent=2, sort_keys=True) + "\n"
        assert cls.from_pretrained(tmp_path / cls.__name__) == config
        assert cls.from_pretrained(path) == config


@pytest.mark.parametrize("saved", [PAPER_FILE, PAPER_FILE_V1], ids=["v2", "v1"])
def test_a_saved_file_loads_as_it_did(tmp_path, saved):
    assert SlimFitConfig.paper().to_dict() == PAPER_FILE
    (tmp_path / "slimfit_config.json").write_text(json.dumps(saved))
    assert SlimFitConfig.from_pretrained(tmp_path) == SlimFitConfig.paper()
    assert SlimFitConfig.from_pretrained(tmp_path, gelu_bits=8) == SlimFitConfig.paper().replace(gelu_bits=8)


def test_a_version_1_file_with_top_k_and_dropout_on_v_loads_them_as_experimental():
    """The research code's choices saved by version 1 (top-k norms and P, their ratio, dropout on V) load
    under ExperimentalSaving: the same patch; two different ratios are refused (one ratio now)."""
    from slimfit.config import ExperimentalSaving

    v1 = {**PAPER_FILE_V1, "layernorm_frozen": "topk", "layernorm_keep_ratio": 0.2,
          "attention": {**PAPER_FILE_V1["attention"], "probs": "topk", "keep_ratio": 0.2, "dropout_on_v": True}}
    loaded = SlimFitConfig.from_dict(v1)
    assert loaded.experimental == ExperimentalSaving(topk_norms="frozen", topk_probs=True, keep_ratio=0.2,
                                                     dropout_on_v=True)
    assert loaded.norm_save(frozen=True) == "topk" and loaded.norm_save(frozen=False) == "int8"
    assert loaded.attention_probs == "topk"
    with pytest.raises(ValueError, match="two ratios"):
        SlimFitConfig.from_dict({**v1, "layernorm_keep_ratio": 0.3})


@pytest.mark.parametrize("cls", [SlimFitConfig, SchedulerConfig])
def test_one_version_rule(cls):
    values, version = cls().to_dict(), cls.CONFIG_VERSION
    with pytest.raises(ValueError, match=rf"{cls.__name__}.from_dict: format version {version + 1} is not one "
                                         rf"this slimfit reads \({version}\)"):
        cls.from_dict({**values, "version": version + 1})
    with pytest.raises(ValueError, match=f"format version '{version}'"):
        cls.from_dict({**values, "version": str(version)})
    with pytest.raises(ValueError, match=r"unknown field\(s\) \['nope'\]"):
        cls.from_dict({**values, "nope": 1})
    assert cls.from_dict({k: v for k, v in values.items() if k != "version"}) == cls()


def test_slimfit_config_errors_in_the_scheduler_style():
    with pytest.raises(ValueError, match=r"SlimFitConfig.layernorm must be one of .*got str 'ful'; "
                                         r"did you mean 'full'\?"):
        SlimFitConfig(layernorm="ful")
    from slimfit.config import ExperimentalSaving

    with pytest.raises(ValueError, match=r"ExperimentalSaving.keep_ratio must be a number in \(0, 1\].*"
                                         r"pass the number itself, not a string: keep_ratio=0.5"):
        ExperimentalSaving(keep_ratio="0.5")
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
