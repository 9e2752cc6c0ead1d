"""The dynamic code of the moment codec (codec.py, dynamic_code.py; 8 and 4 bits), in both roundings (nearest:
stochastic=False; stochastic from the seed, the default): its bounds on adversarial and on real AdamW state,
pieces equal to the whole-tensor entry (nearest) or to each piece encoded alone with its seed (stochastic), a
held step from dynamic entries that is torch's step from their decoded values bit for bit, bytes, old (linear,
and nearest dynamic) entries still read, FrozenState's option and its errors."""
import pytest
import torch
from _optim_models import build, data, frozen_params, loss_of, plain_twin, train

from slimfit.kernels import qmaps
from slimfit.optim import ChunkedStep, FrozenState, attach_frozen_state, codec, held_step
from slimfit.optim.keys import Q8
from slimfit.scheduler import ILSScheduler

G = 128
BITS = [8, 4]


def _per_block(values: torch.Tensor, n: int, group_size: int = G) -> torch.Tensor:
    return values.double().repeat_interleave(group_size)[:n]


def _half_gap_bound(x: torch.Tensor, absmax: torch.Tensor, levels: torch.Tensor, share: float = 0.5) -> torch.Tensor:
    """Per element of flat x: ``share`` of the gap of the map's two levels around x / absmax (half: nearest
    rounding; all of it: stochastic) or the distance to the smallest level below it, times absmax, plus fp32
    rounding of a few ulps of absmax."""
    a = _per_block(absmax, x.numel())
    lv = levels.double()
    t = torch.where(a > 0, x.double() / torch.where(a > 0, a, 1.0), 0.0)
    i = torch.searchsorted(lv, t).clamp(1, lv.numel() - 1)
    return torch.maximum((lv[i] - lv[i - 1]) * share, (lv[0] - t).clamp_min(0)) * a + a * 2**-20


def _wide_second_moment(seed=0) -> torch.Tensor:
    """v over 40 decades in fp32's normal range, zeros, an all-zero block, a short tail block."""
    g = torch.Generator().manual_seed(seed)
    v = torch.exp(torch.empty(37, 61).uniform_(-80, 12, generator=g))   # 2257 elements: tail block of 81
    flat = v.view(-1)
    flat[:G] = 0.0
    flat[2 * G:3 * G:7] = 0.0
    flat[3 * G] = 3e4
    return v


ROUNDINGS = [pytest.param(False, id="nearest"), pytest.param(True, id="stochastic")]


@pytest.mark.parametrize("stochastic", ROUNDINGS)
@pytest.mark.parametrize("bits", BITS)
def test_first_moment_within_the_local_gap(bits, stochastic):
    """Nearest: within half the gap of the two levels around m / absmax; stochastic: one of those two levels,
    so within the whole gap. Either way zeros and each block's largest element come back exactly."""
    g = torch.Generator().manual_seed(1)
    m = torch.randn(50, 77, generator=g) * torch.logspace(-8, 0, 77)
    m.view(-1)[::9] = 0.0
    entry = codec.encode(m, sqrt=False, seed=3, code="dynamic", bits=bits, stochastic=stochastic)
    assert entry["stochastic"] is stochastic
    got = codec.decode(entry).view(-1)
    bound = _half_gap_bound(m.view(-1), entry["absmax"], qmaps.signed(bits), 1.0 if stochastic else 0.5)
    assert ((got.double() - m.view(-1).double()).abs() <= bound).all()
    assert torch.equal(got[::9], torch.zeros_like(got[::9]))                      # zeros exact
    top = m.view(-1)[:128].abs().argmax()
    assert got[top] == m.view(-1)[top]                                            # a block's largest exact


@pytest.mark.parametrize("stochastic", ROUNDINGS)
@pytest.mark.parametrize("bits", BITS)
def test_second_moment_bounds_and_never_zero(bits, stochastic):
    v = _wide_second_moment()
    entry = codec.encode(v, sqrt=True, seed=7, code="dynamic", bits=bits, stochastic=stochastic)
    restored = codec.decode(entry).view(-1)
    s, s_hat = v.view(-1).sqrt(), restored.sqrt()
    bound = _half_gap_bound(s, entry["absmax"], qmaps.unsigned(bits), 1.0 if stochastic else 0.5)
    assert ((s_hat.double() - s.double()).abs() <= bound).all()
    positive = v.view(-1) > 0
    assert (restored[positive] > 0).all()                                        # no 0 for a nonzero v
    floor = qmaps.unsigned(bits)[0] * _per_block(entry["absmax"], v.numel()).float()
    assert (s_hat[positive] >= floor[positive] * (1 - 2**-20)).all()              # never below the smallest level
    assert torch.equal(restored[:G], torch.zeros(G))                             # an all-zero block stays zero


def _adamw_state():
    """AdamW state with zero gradients every third step and gradient magnitudes over 10 decades inside a
    block (harsher than real models: dynamic_code.py's MiniLM measurement has 8-bit updates within 0.83-1.35x)."""
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(300, 70))
    opt = torch.optim.AdamW([p], lr=1e-3)
    for i in range(20):
        p.grad = torch.randn_like(p) * torch.logspace(-9, 1, 70) * (i % 3)
        opt.step()
    return opt.state[p]["exp_avg"], opt.state[p]["exp_avg_sq"]


@pytest.mark.parametrize("stochastic", ROUNDINGS)
@pytest.mark.parametrize("bits", BITS)
def test_update_after_restore_within_the_map_s_bounds(bits, stochastic):
    """With the same m, the update m / (sqrt(v̂) + eps) over the exact one. Nearest: at most the map's largest
    midpoint-to-lower-level ratio (5.5: s just below the midpoint of 1e-8 and 1e-7 of a block's absmax at
    8 bits, of 1e-4 and 1e-3 at 4 bits) and, where s is at or above the smallest level, at least the smallest
    midpoint-to-upper-level ratio (0.55). Stochastic (either level around s): at most the largest ratio of
    neighbouring levels (10, the same places) and at least its inverse. Below the smallest level, v is over-
    never underestimated."""
    m, v = _adamw_state()
    entry = codec.encode(v, sqrt=True, seed=2, code="dynamic", bits=bits, stochastic=stochastic)
    v_hat = codec.decode(entry)
    q = qmaps.unsigned(bits).double()
    upper = (q[1:] + q[:-1]) / 2 if not stochastic else q[1:]
    lower = (q[1:] + q[:-1]) / 2 if not stochastic else q[:-1]
    hi, lo = float((upper / q[:-1]).max()), float((lower / q[1:]).min())
    exact = m / (v.sqrt() + 1e-8)
    ratio = ((m / (v_hat.sqrt() + 1e-8)).abs() / exact.abs()).view(-1)
    inside = (exact != 0).view(-1) & (v.sqrt().view(-1) >= float(q[0]) * _per_block(entry["absmax"], v.numel()))
    assert float(ratio[exact.view(-1) != 0].max()) <= hi * (1 + 1e-5)
    assert float(ratio[inside].min()) >= lo * (1 - 1e-5)
    outside = (exact != 0).view(-1) & ~inside
    assert outside.any() and float(ratio[outside].max()) <= 1 + 1e-5


@pytest.mark.parametrize("stochastic", ROUNDINGS)
def test_dynamic_8_bit_beats_linear_on_moments_spanning_decades(stochastic):
    """The update's error through m̂ (same v) and through v̂ (same m), both codes in the same rounding: the linear
    code restores the many tiny m of a block next to a large one as noise of its step (here the update's error
    is 1e5 times the update). Stochastic rounding's one-shot error is larger than nearest's (it is unbiased
    instead: the error does not accumulate when a moment is encoded again at every step); the bounds are
    this state's measured errors (nearest 0.42 and 0.48, stochastic 2.2 and 0.60) with a margin."""
    m, v = _adamw_state()
    exact = m / (v.sqrt() + 1e-8)

    def errors(code):
        kw = dict(seed=2, code=code, stochastic=stochastic)
        m_hat = codec.decode(codec.encode(m, sqrt=False, **kw))
        v_hat = codec.decode(codec.encode(v, sqrt=True, **kw))
        return [float((u - exact).norm() / exact.norm()) for u in (m_hat / (v.sqrt() + 1e-8),
                                                                    m / (v_hat.sqrt() + 1e-8))]

    (lin_m, lin_v), (dyn_m, dyn_v) = errors("linear"), errors("dynamic")
    if stochastic:
        assert dyn_m < 3 < 1e3 < lin_m and dyn_v < 0.8 * lin_v
    else:
        assert dyn_m < 0.5 < 1e3 < lin_m and dyn_v < 0.7 * lin_v


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("sqrt", [False, True])
def test_pieces_equal_the_whole_tensor_entry(bits, sqrt):
    """Nearest: encode_range_ piece by piece into zeros_entry gives encode's entry (odd numel: a half-filled
    last byte at 4 bits); decode_range of the pieces is decode's."""
    x = torch.randn(7, 333).abs() ** 3 if sqrt else torch.randn(7, 333) * torch.logspace(-6, 0, 333)
    kw = dict(sqrt=sqrt, code="dynamic", bits=bits, stochastic=False)
    whole = codec.encode(x, seed=0, **kw)
    entry = codec.zeros_entry(x.shape, x.dtype, "cpu", **kw)
    flat = x.view(-1)
    for a in range(0, flat.numel(), 3 * G):
        codec.encode_range_(entry, a, flat[a:a + 3 * G], seed=a)
    assert entry.keys() == whole.keys()
    assert torch.equal(entry["codes"], whole["codes"]) and torch.equal(entry["absmax"], whole["absmax"])
    decoded = codec.decode(whole).view(-1)
    for a in range(0, flat.numel(), 2 * G):
        assert torch.equal(codec.decode_range(whole, a, min(a + 2 * G, flat.numel())), decoded[a:a + 2 * G])
    with pytest.raises(ValueError, match="multiple of the group size"):
        codec.decode_range(whole, 5, 100)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("sqrt", [False, True])
def test_stochastic_pieces_are_each_piece_encoded_with_its_seed(bits, sqrt):
    """Stochastic: encode_range_ of a piece with seed s writes what encode gives that piece alone with seed s
    (the uniforms count from the piece's first element, as the linear code's do), so an entry is a function
    of the pieces and their seeds; another seed gives other codes, and the entry's flag decides the rounding:
    a nearest entry (or one without the key, written before the flag) gets nearest pieces."""
    x = torch.randn(7, 333).abs() ** 3 if sqrt else torch.randn(7, 333) * torch.logspace(-6, 0, 333)
    kw = dict(sqrt=sqrt, code="dynamic", bits=bits)
    entry = codec.zeros_entry(x.shape, x.dtype, "cpu", **kw)
    assert entry["stochastic"] is True
    flat = x.view(-1)
    for a in range(0, flat.numel(), 3 * G):
        codec.encode_range_(entry, a, flat[a:a + 3 * G], seed=1000 + a)
    for a in range(0, flat.numel(), 3 * G):
        alone = codec.encode(flat[a:a + 3 * G], seed=1000 + a, **kw)
        piece = codec.decode_range(entry, a, min(a + 3 * G, flat.numel()))
        assert torch.equal(piece, codec.decode(alone))
    other = codec.zeros_entry(x.shape, x.dtype, "cpu", **kw)
    codec.encode_range_(other, 0, flat[:3 * G], seed=1)
    assert not torch.equal(codec.decode_range(other, 0, 3 * G), codec.decode_range(entry, 0, 3 * G))
    nearest = codec.encode(flat[:3 * G], seed=0, stochastic=False, **kw)
    old = {k: v.clone() if torch.is_tensor(v) else v for k, v in entry.items() if k != "stochastic"}
    codec.encode_range_(old, 0, flat[:3 * G], seed=1)
    assert torch.equal(codec.decode_range(old, 0, 3 * G), codec.decode(nearest))


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("numel", [1, 127, 129, 40_001])
def test_zeros_entry_is_encode_of_zeros(bits, numel):
    for sqrt in (False, True):
        z = codec.zeros_entry((numel,), torch.bfloat16, "cpu", sqrt=sqrt, code="dynamic", bits=bits)
        e = codec.encode(torch.zeros(numel, dtype=torch.bfloat16), sqrt=sqrt, seed=0, code="dynamic", bits=bits)
        assert z.keys() == e.keys() and all(torch.equal(z[k], e[k]) for k in ("codes", "absmax"))
        assert torch.equal(codec.decode(z), torch.zeros(numel, dtype=torch.bfloat16))


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("numel", [1, 127, 128, 129, 40_000])
def test_bytes(bits, numel):
    entry = codec.encode(torch.rand(numel), sqrt=True, seed=0, code="dynamic", bits=bits)
    assert codec.entry_nbytes(entry) == codec.encoded_nbytes(numel, G, "dynamic", bits)
    assert codec.encoded_nbytes(numel, G, "dynamic", bits) == -(-numel * bits // 8) + 4 * -(-numel // G)
    assert codec.code_of(entry) == {"code": "dynamic", "bits": bits}
    big = 128 * 1000
    ratio = 4 * big / codec.encoded_nbytes(big, G, "dynamic", bits)
    assert ratio == pytest.approx(3.878787 if bits == 8 else 7.529411, rel=1e-6)


def test_linear_entries_without_the_key_still_read():
    """Entries written before the dynamic code (no "dynamic" key) are linear: decoded, counted and described
    as before."""
    v = torch.rand(1000) ** 4
    entry = codec.encode(v, sqrt=True, seed=0)
    assert "dynamic" not in entry and codec.is_encoded(entry) and codec.code_of(entry) == {"code": "linear", "bits": 8}
    assert codec.entry_nbytes(entry) == codec.encoded_nbytes(1000) == 1000 + 8 * 8
    dyn = codec.encode(v, sqrt=True, seed=0, code="dynamic")
    assert codec.is_encoded(dyn) and not codec.is_encoded({k: v for k, v in dyn.items() if k != "absmax"})
    cast = {**dyn, "codes": dyn["codes"].float()}          # a plain Optimizer.load_state_dict's cast
    assert torch.equal(codec.decode(cast), codec.decode(dyn))


@pytest.mark.parametrize("fused", [False, True], ids=["round", "fused"])
def test_dynamic_entries_without_the_rounding_key_load_and_stay_nearest(fused, monkeypatch):
    """A checkpoint whose dynamic entries have no "stochastic" key (written when the code rounded to nearest
    only) loads into a held optimizer, steps, and its pieces are encoded to nearest from then on: torch's new
    moments coded whole, bit for bit through the unfused round; through the op (slimfit's own arithmetic, a few
    fp32 ulps from torch's) all but the codes whose value sits within those ulps of a midpoint (measured: 1 of a
    40,000-element weight's codes at 2 threads, none at 1; allowed: one in 1,000)."""
    monkeypatch.setattr(held_step, "FUSED", fused)
    model, opt, _, _ = _held_setup(8)
    _step(model, opt, data(seed=0))
    sd = opt.state_dict()
    held = sd["slimfit_held"]                  # the live entries: copied without the key, not changed
    assert all(e["stochastic"] is True for st in held.values() for e in st.values())
    sd["slimfit_held"] = {i: {k: {f: v for f, v in e.items() if f != "stochastic"} for k, e in st.items()}
                          for i, st in held.items()}
    model2, opt2, _, _ = _held_setup(8)
    model2.load_state_dict(model.state_dict())
    opt2.load_state_dict(sd)
    ref, ref_opt = plain_twin(model2, opt2)
    _step(model2, opt2, data(seed=1))
    _step(ref, ref_opt, data(seed=1))
    for p, q in zip(model2.parameters(), ref.parameters()):
        for key, sqrt in (("exp_avg", False), ("exp_avg_sq", True)):
            entry = opt2.state[p][key + Q8]
            whole = codec.encode(ref_opt.state[q][key], sqrt=sqrt, seed=0, code="dynamic", stochastic=False)
            assert "stochastic" not in entry
            differ = int((entry["codes"] != whole["codes"]).sum())
            assert differ <= (entry["codes"].numel() // 1000 if fused else 0), (key, differ)


def test_bad_codes_are_refused():
    x = torch.randn(300)
    for kwargs, words in ((dict(code="log"), "code must be one of"), (dict(code="linear", bits=4), "8-bit only"),
                          (dict(code="dynamic", bits=2), "8 or 4 bits"),
                          (dict(code="dynamic", group_size=100), "block size")):
        with pytest.raises(ValueError, match=words):
            codec.encode(x, sqrt=False, seed=0, **kwargs)


# ------------------------------------------------------------------ through FrozenState
def _held_setup(bits, chunk=1024, seed=0, stochastic=True):
    model = build(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    step = ChunkedStep(opt, chunk_numel=chunk)
    holder = FrozenState(opt, "compress", between_steps=True, seed=seed, code="dynamic", bits=bits,
                         stochastic=stochastic)
    return model, opt, step, holder


def _step(model, opt, batch):
    loss_of(model, batch).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


@pytest.mark.parametrize("stochastic", ROUNDINGS)
@pytest.mark.parametrize("bits", BITS)
def test_a_step_from_dynamic_entries_is_torch_s_step_from_their_decoded_values(bits, stochastic, monkeypatch):
    """The held step's weights are torch's step from the decoded moments bit for bit; its entries are torch's new
    moments coded whole (nearest) or each call's pieces coded together from the holder's seeds (stochastic:
    _entries_are_the_calls_encodings). The unfused round (8-bit entries otherwise go through one op:
    tests/optim/test_fused_held_step.py)."""
    monkeypatch.setattr(held_step, "FUSED", False)
    model, opt, _, holder = _held_setup(bits, stochastic=stochastic)   # 200x200 weights in 40 pieces of 1024
    for s in range(3):
        _step(model, opt, data(seed=s))
    for st in opt.state.values():
        assert all(st[k + Q8].get("dynamic") and st[k + Q8]["bits"] == bits and st[k + Q8]["stochastic"] is stochastic
                   for k in ("exp_avg", "exp_avg_sq"))
    ref, ref_opt = plain_twin(model, opt)
    _step(model, opt, data(seed=3))
    _step(ref, ref_opt, data(seed=3))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    for p, q in zip(model.parameters(), ref.parameters()):   # entries: torch's new moments, coded
        for key, sqrt in (("exp_avg", False), ("exp_avg_sq", True)):
            entry, new = opt.state[p][key + Q8], ref_opt.state[q][key]
            if not stochastic:
                whole = codec.encode(new, sqrt=sqrt, seed=0, code="dynamic", bits=bits, stochastic=False)
                assert torch.equal(entry["codes"], whole["codes"]) and torch.equal(entry["absmax"], whole["absmax"])
                continue
    if stochastic:
        _entries_are_the_calls_encodings(model, opt, ref, ref_opt, holder)


def _entries_are_the_calls_encodings(model, opt, ref, ref_opt, holder):
    """Each call of the held step (held_step._batches: the 1024-element pieces, small parameters packed)
    encodes torch's new moments of its pieces as codec.encode_ranges_ does, with the holder's seed of each
    piece, parameter, moment and step (seed_for; the call's first piece's seed rounds its alike pieces)."""
    params = list(model.parameters())
    twin = dict(zip(params, ref.parameters()))
    states = [opt.state[p] for p in params]
    before = {"step": float(states[0]["step"]) - 1}
    calls = list(held_step._batches(params, states, [1.0] * len(params), 1024, "exp_avg" + Q8))
    assert any(len(call) > 1 for _, call in calls)   # packed calls: the seed rule is seen
    for _, call in calls:
        for key in ("exp_avg", "exp_avg_sq"):
            copies = {i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in states[i][key + Q8].items()}
                      for i, _, _ in call}
            codec.encode_ranges_([(copies[i], a, ref_opt.state[twin[params[i]]][key].reshape(-1)[a:b],
                                   holder.seed_for(params[i], key, before, start=a)) for i, a, b in call])
            for i, a, b in call:
                got = codec.decode_range(states[i][key + Q8], a, b)
                assert torch.equal(got, codec.decode_range(copies[i], a, b)), (key, i, a)


@pytest.mark.parametrize("bits", BITS)
def test_frozen_layers_hold_dynamic_entries_and_bytes_are_counted(bits):
    model = build(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = ILSScheduler(model, freeze_rate=0.5, optimizer=opt, frozen_state=None, warmup_steps=0)
    holder = attach_frozen_state(sched, opt, mode="compress", code="dynamic", bits=bits)
    train(model, opt, data(), 4, sched=sched)
    held = frozen_params(sched)
    assert held and all(opt.state[p]["exp_avg" + Q8]["bits"] == bits for p in held if opt.state.get(p))
    want = sum(codec.encoded_nbytes(p.numel(), G, "dynamic", bits) * 2 for p in holder.held_params())
    assert holder.held_nbytes() == want
    p = holder.held_params()[0]
    entry = opt.state[p]["exp_avg_sq" + Q8]
    holder.thaw([p])
    assert torch.equal(opt.state[p]["exp_avg_sq"], codec.decode(entry))


def test_frozen_state_option_errors_name_the_choices():
    opt = torch.optim.AdamW(build(0).parameters())
    for bad, words in ((dict(code="nf4"), "code must be one of"), (dict(code="linear", bits=4), "8-bit only"),
                       (dict(code="dynamic", bits=6), "8 or 4 bits"), (dict(code="dynamic", bits="8"), "bits must"),
                       (dict(code="dynamic", group_size=100), "block size")):
        with pytest.raises(ValueError, match=words):
            FrozenState(opt, **bad)
    assert FrozenState(opt, code="dynamic", bits=4).codec_options()["code"] == "dynamic"
    assert FrozenState(opt).codec_options()["code"] == "dynamic"   # the scheduler's default code, dynamic8


def test_fake_tensors_encode_and_decode():
    """slimfit.plan runs the step on fake tensors: the dynamic code's shapes without data."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        v = torch.empty(1000)
        entry = codec.encode(v, sqrt=True, seed=0, code="dynamic", bits=4)
        z = codec.zeros_entry((1000,), torch.float32, "cpu", sqrt=False, code="dynamic")
        out = codec.decode_range(entry, 128, 1000)
    assert entry["codes"].shape == (500,) and entry["absmax"].shape == (8,) and out.shape == (872,)
    assert z["codes"].shape == (1000,)


def test_checkpoints_carry_dynamic_entries():
    """The portable checkpoint: a plain AdamW loads the decoded moments (decode's values, piece by piece);
    a FrozenState's optimizer gets the dynamic entries back exactly."""
    from slimfit.optim import held_state_dict, restore_state

    model, opt, _, _ = _held_setup(4)
    for s in range(2):
        _step(model, opt, data(seed=s))
    sd = opt.state_dict()
    plain = torch.optim.AdamW(build(0).parameters(), lr=1e-2, weight_decay=0.1)
    plain.load_state_dict(sd)
    for p, q in zip(model.parameters(), plain.param_groups[0]["params"]):
        assert torch.equal(plain.state[q]["exp_avg_sq"], codec.decode(opt.state[p]["exp_avg_sq" + Q8]))
    model2, opt2, _, _ = _held_setup(4)
    opt2.load_state_dict(sd)
    for p, q in zip(model.parameters(), model2.parameters()):
        a, b = opt.state[p]["exp_avg" + Q8], opt2.state[q]["exp_avg" + Q8]
        assert b["codes"].dtype == torch.uint8 and b["bits"] == 4
        assert torch.equal(a["codes"], b["codes"]) and torch.equal(a["absmax"], b["absmax"])
    plain2 = torch.optim.AdamW(build(0).parameters())    # the slimfit-only format, decoded by hand
    plain2.load_state_dict(held_state_dict(opt))
    assert restore_state(plain2) == len(list(model.parameters()))
