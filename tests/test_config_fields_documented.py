"""Every field of every config class is named in docs/*.md, so a user reading the docs finds each knob.

A field counts as documented when its name appears as a word inside inline code (`name`, `name=...`,
`cfg.name`) on some page under docs/. The failure lists the class and field left out.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from slimfit.config import AttentionSaving, ExperimentalSaving, LinearSampling, SlimFitConfig
from slimfit.scheduler.config import ExperimentalOptions, SchedulerConfig

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = (SlimFitConfig, AttentionSaving, LinearSampling, ExperimentalSaving, SchedulerConfig, ExperimentalOptions)


def _inline_code(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text)


def _documented(name: str, spans: list[str]) -> bool:
    word = re.compile(rf"(?<![\w]){re.escape(name)}(?![\w])")
    return any(word.search(span) for span in spans)


@pytest.fixture(scope="module")
def spans() -> list[str]:
    return [s for page in sorted((ROOT / "docs").glob("*.md")) for s in _inline_code(page.read_text("utf-8"))]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: c.__name__)
def test_every_config_field_is_documented(config, spans):
    missing = [f.name for f in dataclasses.fields(config) if not _documented(f.name, spans)]
    assert not missing, f"{config.__name__} fields named nowhere in docs/*.md (inline code): {missing}"


def test_the_check_sees_a_field_left_out():
    assert _documented("keep_ratio", ["experimental.keep_ratio"])
    assert not _documented("keep_ratio", ["layernorm_keep_ratio"])
    assert not _documented("seed", _inline_code("the seed of a run, `x=1`"))   # prose outside code does not count
