"""The counter-based generator every backend shares (slimfit/kernels/rng.py): the formula of the
specification, uniform in [0, 1). (Triton's device-side copy: test_triton_launchers.py.)"""
import torch

from slimfit.kernels import rng


def test_rng_matches_scalar_hash():
    seed = 2**40 + 17
    k0, k1 = rng.seed_keys(seed)
    words = rng.random_words(seed, 5, "cpu")
    for i in range(5):
        assert int(words[i]) == rng.lowbias32_int(rng.lowbias32_int(i ^ k0) ^ 0 ^ k1)


def test_uniform_is_uniform():
    u = rng.uniform(7, 200_000, "cpu")
    assert 0.0 <= u.min().item() and u.max().item() < 1.0
    assert abs(u.mean().item() - 0.5) < 0.005
    hist = torch.histc(u, bins=10, min=0, max=1) / u.numel()
    assert (hist - 0.1).abs().max().item() < 0.005
