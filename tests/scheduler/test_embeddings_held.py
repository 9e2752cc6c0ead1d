"""SchedulerConfig.embeddings: the input embedding table trained (the default, "train"), or held frozen for the run
with a head tied to it ("freeze"), refused where it cannot be held ("freeze" without a model)."""
import copy

import pytest
import torch
from _models import bert_batch, tiny_bert
from transformers import LlamaConfig, LlamaForCausalLM

from slimfit.scheduler import ILSScheduler, SchedulerConfig

TABLE = "model.embed_tokens.weight"


def _llama(tied: bool, seed: int = 0):
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied))


def _batch(seed: int):
    ids = torch.randint(0, 64, (2, 10), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def _train(model, optimizer, scheduler, steps: int, frozen_log: list | None = None):
    for step in range(steps):
        if frozen_log is not None:
            frozen_log.append(set(scheduler.frozen_names()))
        model(**_batch(step)).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()


@pytest.mark.parametrize("tied", [True, False])
def test_a_causal_lms_table_is_held_frozen_and_every_other_weight_trains_as_torch_would(tied):
    """The scheduler's run against torch's AdamW on a copy whose table is frozen by hand and whose other layers
    follow the scheduler's frozen sets: the same weights bit for bit (state in full: the chunked step's arithmetic
    is torch's), the table (and a tied head) unmoved, no optimizer state for it."""
    model = _llama(tied)
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = ILSScheduler(model, 0.5, optimizer=opt, warmup_steps=0, optimizer_state="full", embeddings="freeze")
    assert sched.embeddings == "freeze" and [n for n, _ in sched.held_frozen] == [TABLE]
    assert TABLE not in sched.names and ("lm_head.weight" in sched.names) == (not tied)
    table = model.model.embed_tokens.weight
    before = table.detach().clone()
    frozen_sets: list = []
    _train(model, opt, sched, 4, frozen_sets)
    assert not table.requires_grad and table.grad is None and torch.equal(table, before)
    assert table not in opt.state

    ref_params = dict(reference.named_parameters())
    ref_params[TABLE].requires_grad_(False)
    ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=1e-2)
    for step, frozen in enumerate(frozen_sets):
        for name in sched.names:
            ref_params[name].requires_grad_(name not in frozen)
        reference(**_batch(step)).loss.backward()
        ref_opt.step()
        ref_opt.zero_grad(set_to_none=True)
    moved = 0
    for name, p in model.named_parameters():
        assert torch.equal(p, ref_params[name]), name
        moved += not torch.equal(p, dict(_llama(tied).named_parameters())[name])
    assert moved == len(list(model.parameters())) - 1   # every weight but the table moved
    sched.close()
    assert table.requires_grad   # close() gives the table back


def test_the_held_table_gets_no_8bit_moments():
    """Every moment 8-bit (the default): state is made up front for every optimizer parameter but the table."""
    model = _llama(tied=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = ILSScheduler(model, 0.5, optimizer=opt, warmup_steps=0, embeddings="freeze")
    _train(model, opt, sched, 2)
    table = model.model.embed_tokens.weight
    assert table not in opt.state and all(p in opt.state for p in model.parameters() if p is not table)


def test_the_default_schedules_a_tied_table_and_trains_an_untied_one_every_step():
    tied, untied = _llama(tied=True), _llama(tied=False)
    assert TABLE in ILSScheduler(tied, 0.5).names   # a tied table is a weight matrix
    sched = ILSScheduler(untied, 0.5, warmup_steps=0)
    assert sched.embeddings == "train"
    opt = torch.optim.AdamW(untied.parameters(), lr=1e-2)
    sched.attach_optimizer(opt)
    table = untied.model.embed_tokens.weight
    before = table.detach().clone()
    _train(untied, opt, sched, 1)
    assert sched.held_frozen == [] and not torch.equal(before, table)


def test_freeze_holds_an_encoders_table_too():
    model = tiny_bert()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = ILSScheduler(model, 0.7, optimizer=opt, warmup_steps=0, embeddings="freeze")
    table = model.bert.embeddings.word_embeddings.weight
    assert [p for _, p in sched.held_frozen] == [table]
    before = table.detach().clone()
    model(**bert_batch()).loss.backward()
    opt.step()
    assert torch.equal(before, table) and table not in opt.state


def test_freeze_where_it_cannot_hold_is_refused_with_the_fix():
    model = _llama(tied=False)
    with pytest.raises(ValueError, match="requires_grad_"):
        ILSScheduler(list(model.named_parameters()), 0.5, embeddings="freeze")
    with pytest.raises(ValueError, match="scheduled_kinds"):
        SchedulerConfig(embeddings="freeze", scheduled_kinds=("matmul", "embedding"))
    with pytest.raises(ValueError, match="embeddings"):
        SchedulerConfig(embeddings="frozen")


def test_the_choice_is_saved_and_an_older_config_loads_as_train():
    model = _llama(tied=True)
    sched = ILSScheduler(model, 0.5, embeddings="freeze")
    assert sched.state_dict()["config"]["embeddings"] == "freeze"
    assert SchedulerConfig.from_dict(sched.config.to_dict()).embeddings == "freeze"
    old = SchedulerConfig().to_dict()
    del old["embeddings"]
    assert SchedulerConfig.from_dict(old).embeddings == "train"


def test_a_second_scheduler_over_the_held_table_is_refused():
    model = _llama(tied=True)
    first = ILSScheduler(model, 0.5, embeddings="freeze")
    second = ILSScheduler(model, 0.0, layers=[TABLE])   # built before the first started: the table is a candidate
    first.apply()
    with pytest.raises(ValueError, match="close"):
        second.apply()
    first.close()
    assert model.model.embed_tokens.weight.requires_grad
