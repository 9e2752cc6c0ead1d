"""Writing and reading a config's JSON file beside a checkpoint (SlimFitConfig, SchedulerConfig)."""
from __future__ import annotations

import json
import os


def save_json(values: dict, save_directory, name: str) -> str:
    """Write `values` as `save_directory`/`name` (the folder made if needed); returns the file's path."""
    os.makedirs(save_directory, exist_ok=True)
    path = os.path.join(save_directory, name)
    with open(path, "w") as f:
        json.dump(values, f, indent=2, sort_keys=True)
        f.write("\n")
    return path


def load_json(path, name: str, owner: str) -> dict:
    """The values of `path`/`name` (or of the file `path`), with errors naming `owner` and the file."""
    file = os.path.join(path, name) if os.path.isdir(path) else path
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{owner}.from_pretrained: no {name} at {path!r}")
    with open(file) as f:
        try:
            return json.load(f)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{owner}.from_pretrained: {file} is not valid JSON ({exc})") from None
