"""candidate_kinds (matmul / norm / embedding) and ILSScheduler(scheduled_kinds=...): the kinds
left out of scheduling train every step."""
import pytest
import torch
from _models import bert_batch, tiny_bert

from slimfit.scheduler import ILSScheduler
from slimfit.scheduler.candidates import candidate_kinds, find_candidates


def _kinds(model):
    return candidate_kinds(model, find_candidates(model))


def test_bert_kinds():
    kinds = _kinds(tiny_bert())
    assert {n for n, k in kinds.items() if k == "embedding"} == {
        f"bert.embeddings.{t}_embeddings.weight" for t in ("word", "position", "token_type")}
    norms = {n for n, k in kinds.items() if k == "norm"}
    assert len(norms) == 5 and all(n.endswith("LayerNorm.weight") for n in norms)
    assert kinds["classifier.weight"] == kinds["bert.encoder.layer.0.attention.self.query.weight"] == "matmul"


def test_vit_tokens_are_embeddings_and_the_patch_conv_is_a_matmul():
    from transformers import Dinov2Config, Dinov2ForImageClassification

    model = Dinov2ForImageClassification(Dinov2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                                      intermediate_size=64, image_size=28, patch_size=14))
    kinds = _kinds(model)
    assert {n for n, k in kinds.items() if k == "embedding"} == {
        "dinov2.embeddings.cls_token", "dinov2.embeddings.mask_token", "dinov2.embeddings.position_embeddings"}
    assert kinds["dinov2.embeddings.patch_embeddings.projection.weight"] == "matmul"


@pytest.mark.parametrize("tied", [True, False])
def test_an_embedding_tied_to_the_lm_head_is_a_matmul(tied):
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                         intermediate_size=64, tie_word_embeddings=tied))
    kinds = _kinds(model)
    assert kinds["model.embed_tokens.weight"] == ("matmul" if tied else "embedding")
    assert kinds["model.norm.weight"] == "norm"


def test_a_parameter_list_is_classified_by_name_like_the_module():
    model = tiny_bert()
    pairs = find_candidates(list(model.named_parameters()))
    assert candidate_kinds(None, pairs) == _kinds(model)


def test_unscheduled_kinds_train_every_step():
    model = tiny_bert()
    kinds = _kinds(model)    # before the scheduler freezes anything (frozen parameters are no candidates)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = ILSScheduler(model, 0.7, optimizer=opt, scheduled_kinds="matmul", always_train=(), warmup_steps=0)
    assert set(sched.names) == {n for n, k in kinds.items() if k == "matmul"}
    assert sched.state_dict()["config"]["scheduled_kinds"] == ["matmul"]
    params = dict(model.named_parameters())
    always = [n for n, k in kinds.items() if k != "matmul" and n != "bert.embeddings.token_type_embeddings.weight"]
    batch = bert_batch()
    for _ in range(4):
        before = {n: params[n].detach().clone() for n in always}
        assert sched.num_frozen == round(0.7 * len(sched.names))
        model(**batch).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        for n in always:                    # moved at every step (token type 1 never occurs in the batch)
            assert params[n].requires_grad and not torch.equal(params[n].detach(), before[n]), n


def test_scheduled_kinds_errors_and_explicit_layers():
    model = tiny_bert()
    kinds = _kinds(model)
    with pytest.raises(ValueError, match="scheduled_kinds must be"):
        ILSScheduler(model, 0.7, scheduled_kinds="linear")
    with pytest.raises(ValueError, match="scheduled_kinds must be"):
        ILSScheduler(model, 0.7, scheduled_kinds=())
    only_norms = [n for n, k in kinds.items() if k == "norm"]
    with pytest.raises(ValueError, match="leaves no layer to schedule"):
        ILSScheduler(model, 0.5, layers=only_norms, scheduled_kinds="embedding")
    # An explicit layer list is scheduled whole unless scheduled_kinds is given too.
    assert ILSScheduler(model, 0.5, layers=only_norms).names == only_norms
    assert ILSScheduler(model, 0.5, scheduled_kinds="all", always_train=()).num_layers == len(kinds)
    assert ILSScheduler(model, 0.5, scheduled_kinds="all").num_layers == len(kinds) - 1   # the head trains


def test_by_default_embeddings_and_norms_train_every_step():
    model = tiny_bert()
    kinds = _kinds(model)
    sched = ILSScheduler(model, 0.7)
    assert set(sched.names) == {n for n, k in kinds.items() if k == "matmul"} - {"classifier.weight"}
    assert sched.scheduled_kinds == ("matmul",)
