"""`slimfit demo --data hf:NAME[:CONFIG]` without network: a stand-in `datasets` module serves
splits shaped like the hub's (GLUE-style hidden test labels, other text column names)."""
import sys
import types

import pytest

from slimfit.demo.assets import hub_dataset, load_data
from slimfit.training.finetune import count_labels


class _Feature:
    def __init__(self, dtype):
        self.dtype = dtype


class _Split:
    """The slice of `datasets.Dataset` that hub_dataset uses."""

    def __init__(self, columns: dict, dtypes: dict):
        self.columns, self.features = columns, {c: _Feature(dtypes[c]) for c in columns}

    def __len__(self):
        return len(next(iter(self.columns.values())))

    def __getitem__(self, col):
        return list(self.columns[col])

    def select(self, indices):
        idx = list(indices)
        return _Split({c: [v[i] for i in idx] for c, v in self.columns.items()},
                      {c: f.dtype for c, f in self.features.items()})

    def shuffle(self, seed):
        order = list(range(len(self)))[::-1]  # deterministic stand-in for a seeded shuffle
        return self.select(order)


def _split(texts, labels, text_col="text"):
    return _Split({"idx": list(range(len(texts))), text_col: texts, "label": labels},
                  {"idx": "int32", text_col: "string", "label": "int64"})


@pytest.fixture
def fake_datasets(monkeypatch):
    calls = []
    registry = {}

    def load_dataset(name, config=None):
        calls.append((name, config))
        return registry[(name, config)]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    return registry, calls


def test_glue_config_hidden_test_labels_fall_back_to_validation(fake_datasets):
    registry, calls = fake_datasets
    registry[("glue", "sst2")] = {
        "train": _split([f"t{i}" for i in range(6)], [0, 1, 0, 1, 0, 1], "sentence"),
        "validation": _split(["v0", "v1"], [1, 0], "sentence"),
        "test": _split(["x0", "x1"], [-1, -1], "sentence"),
    }
    train, test = load_data("hf:glue:sst2", seed=0, n_train=4, n_test=5)
    assert calls == [("glue", "sst2")]
    assert train == [("t5", 1), ("t4", 0), ("t3", 1), ("t2", 0)]
    assert test == [("v0", 1), ("v1", 0)]


def test_single_string_column_is_the_text(fake_datasets):
    registry, _ = fake_datasets
    registry[("reviews", None)] = {"train": _split(["a", "b"], [0, 1], "review"),
                                   "test": _split(["c"], [1], "review")}
    train, test = hub_dataset("reviews", seed=0, n_train=10, n_test=10)
    assert sorted(train) == [("a", 0), ("b", 1)] and test == [("c", 1)]


def test_unscorable_or_unreadable_sets_name_the_problem(fake_datasets):
    registry, _ = fake_datasets
    registry[("hidden", None)] = {"train": _split(["a", "b"], [0, 1]), "test": _split(["c"], [-1])}
    with pytest.raises(ValueError, match="no labelled 'test' or 'validation' split"):
        hub_dataset("hidden", 0, 2, 2)
    two_texts = _Split({"premise": ["p"], "hypothesis": ["h"], "label": [0]},
                       {"premise": "string", "hypothesis": "string", "label": "int64"})
    registry[("pairs", None)] = {"train": two_texts, "validation": two_texts}
    with pytest.raises(ValueError, match="cannot tell which column is the text"):
        hub_dataset("pairs", 0, 2, 2)
    registry[("nolabel", None)] = {"train": _Split({"text": ["a"]}, {"text": "string"})}
    with pytest.raises(ValueError, match="no 'label' column"):
        hub_dataset("nolabel", 0, 2, 2)


def test_missing_datasets_package_says_how_to_install(monkeypatch):
    from slimfit.demo.assets import MissingAsset

    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(MissingAsset, match="pip install datasets"):
        hub_dataset("imdb", 0, 2, 2)


def test_label_count_follows_the_data():
    assert count_labels([("a", 0), ("b", 3)], [("c", 1)]) == 4
    with pytest.raises(ValueError, match="negative"):
        count_labels([("a", 0), ("b", 1)], [("c", -1)])
    with pytest.raises(ValueError, match="Python ints"):
        count_labels([("a", "pos"), ("b", "neg")], [])
    with pytest.raises(ValueError, match="single class"):
        count_labels([("a", 1), ("b", 1)], [("c", 0)])


def test_demo_reports_a_bad_data_spec_without_a_traceback(capsys):
    pytest.importorskip("transformers")
    from slimfit.cli import main

    rc = main(["demo", "--model", "a-local-path", "--data", "imdb", "--no-progress"])
    assert rc == 2
    assert "hf:NAME[:CONFIG]" in capsys.readouterr().err


@pytest.mark.parametrize("flags, message", [(["--rate", "1.0"], "--rate 1.0"), (["--steps", "0"], "--steps 0"),
                                            (["--lr", "0"], "--lr 0")])
def test_demo_rejects_bad_flags_before_training(capsys, flags, message):
    pytest.importorskip("transformers")
    from slimfit.cli import main

    assert main(["demo", "--model", "a-local-path", "--no-progress", *flags]) == 2
    assert message in capsys.readouterr().err
