"""StepSpec.embeddings: the plan of a step whose input embedding table (tied to the LM head) is held frozen leaves out
the table's gradient and optimizer state; asked without a scheduler, it is refused."""
import pytest

from slimfit.plan import StepSpec, predict


def test_a_held_table_is_planned_without_its_gradient_and_state():
    spec = StepSpec("smollm2-135m", batch=1, seq=32, preset="paper", rate=0.7, layers=2, task="causal-lm")
    trained, held = predict(spec), predict(spec.replace(embeddings="freeze"))
    table = 49152 * 576   # SmolLM2's tied table
    assert held.optimized == trained.optimized - table
    # at least its 8-bit moments (2 bytes an element) less at the peak
    assert trained.memory.total - held.memory.total >= 2 * table
    assert "input embedding held frozen" in held.spec.label()


def test_embeddings_freeze_needs_a_scheduler():
    with pytest.raises(ValueError, match="needs a freeze rate"):
        StepSpec("smollm2-135m", batch=1, seq=32, embeddings="freeze")
    with pytest.raises(ValueError, match="embeddings must be one of"):
        StepSpec("smollm2-135m", batch=1, seq=32, rate=0.7, embeddings="auto")
