"""slimfit/plan/models.py: what a model argument can be (architecture, config, config file, cached hub id)."""
from __future__ import annotations

import pytest

from slimfit import architectures as archs
from slimfit.plan import StepSpec, predict, resolve_model


def test_architecture_names_and_aliases():
    ref = resolve_model("smollm2")
    assert ref.name == "smollm2-135m" and ref.task == archs.CAUSAL_LM and ref.model_class == "LlamaForCausalLM"


def test_a_config_object_and_a_config_file_give_the_same_prediction(tmp_path):
    import transformers

    config = transformers.LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      architectures=["LlamaForCausalLM"])
    config.save_pretrained(tmp_path)
    from_object, from_file = resolve_model(config), resolve_model(str(tmp_path))
    assert from_object.task == from_file.task == archs.CAUSAL_LM and from_file.source == "file"
    a = predict(StepSpec(config, batch=1, seq=32)).total
    b = predict(StepSpec(str(tmp_path / "config.json"), batch=1, seq=32)).total
    assert a == b


def test_task_is_inferred_from_the_config_and_can_be_overridden():
    import transformers

    assert resolve_model(transformers.BertConfig()).task == archs.TEXT_CLS
    assert resolve_model(transformers.ViTConfig()).task == archs.IMAGE_CLS
    assert resolve_model(transformers.Qwen2Config()).task == archs.CAUSAL_LM
    assert resolve_model("llama-tiny", task=archs.TEXT_CLS).task == archs.TEXT_CLS


def test_a_hub_id_not_in_the_cache_says_it_is_read_offline(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    with pytest.raises(ValueError, match="local cache"):
        resolve_model("no-such-org/no-such-model")
