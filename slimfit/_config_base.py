"""What slimfit's two configs share (SlimFitConfig, slimfit.config; SchedulerConfig, slimfit.scheduler.config):
the checks of a field, with one error style, and the saved form (a format version, a JSON file beside a
checkpoint).

Pure Python (json, os, difflib): the scheduler imports it without the patch layer.

Checks. Each names the owner and the field, what the value must be, the value with its type, and, where one
exists, the fix: ``SchedulerConfig.score must be one of ('relative', 'robust'), got str 'relativ'; did you
mean 'relative'?``. They raise ValueError (``error`` builds it) and return the value as checked.

Saved form. ``ConfigBase`` gives a config class ``save_pretrained`` / ``from_pretrained`` (the JSON file
``CONFIG_NAME``) over its own ``to_dict`` / ``from_dict``; ``read_version`` takes the format ``version`` out
of a saved dict and refuses one this slimfit does not read; ``refuse_unknown`` refuses keys that are no field.
"""
from __future__ import annotations

import difflib
import json
import math
import numbers
import os
from typing import Callable, ClassVar, Optional

__all__ = ["ConfigBase", "error", "shown", "is_number", "number_fix", "real", "integer", "flag", "closest",
           "did_you_mean", "choice", "refuse_unknown", "read_version", "save_json", "load_json"]


# ---------------------------------------------------------------------------------------------- checks
def shown(value) -> str:
    """A value as an error shows it: its type and its repr, cut at 80 characters."""
    return f"{type(value).__name__} {value!r:.80}"


def error(owner: str, name: str, rule: str, value, fix: str = "") -> ValueError:
    """The error of a bad field: `owner.name must be <rule>, got <value>; <fix>`."""
    return ValueError(f"{owner}.{name} must be {rule}, got {shown(value)}" + (f"; {fix}" if fix else ""))


def is_number(value) -> bool:
    """A real number that is not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def number_fix(name: str, value, example) -> str:
    """How to fix a bad number: a string that holds one, a bool, or anything else."""
    if isinstance(value, bool):
        return f"{value} is a bool, not a number: pass e.g. {name}={example}"
    if isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            return f"pass e.g. {name}={example}"
        return f"pass the number itself, not a string: {name}={int(number) if number.is_integer() else number!r}"
    return f"pass e.g. {name}={example}"


def real(owner: str, name: str, value, rule: str, ok: Callable[[float], bool], example) -> float:
    """A finite real number for which `ok` holds, as a float."""
    if not is_number(value) or not math.isfinite(float(value)) or not ok(float(value)):
        raise error(owner, name, rule, value, number_fix(name, value, example))
    return float(value)


def integer(owner: str, name: str, value, low: int, meaning: str, example, optional: bool = False):
    """An int >= `low` (None too when `optional`)."""
    if optional and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < low:
        rule = f"{'None or ' if optional else ''}an int >= {low} ({meaning})"
        raise error(owner, name, rule, value, number_fix(name, value, example))
    return int(value)


def flag(owner: str, name: str, value, optional: bool = False):
    """True or False (None too when `optional`)."""
    if not isinstance(value, bool) and not (optional and value is None):
        raise error(owner, name, "None, True or False" if optional else "True or False", value)
    return value


def closest(value, allowed) -> Optional[str]:
    """The allowed string closest to a misspelt one (None: no string, or none close)."""
    if not isinstance(value, str):
        return None
    close = difflib.get_close_matches(value, sorted(a for a in allowed if isinstance(a, str)), n=1)
    return close[0] if close else None


def did_you_mean(value, allowed) -> str:
    close = closest(value, allowed)
    return f"did you mean {close!r}?" if close else ""


def choice(owner: str, name: str, value, allowed: tuple, fix: str = ""):
    """One of `allowed` (strings, numbers or None; a bool is never one of them)."""
    if (not isinstance(value, bool) and (value is None or isinstance(value, (str, numbers.Number)))
            and value in allowed):
        return value
    raise error(owner, name, f"one of {allowed}", value, fix or did_you_mean(value, allowed))


def refuse_unknown(where: str, values, known) -> None:
    """Refuse, by name, the keys of a saved dict that are no field (written by another version?)."""
    unknown = sorted(k for k in values if k not in known)
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {unknown} (written by another slimfit version?); "
                         f"known fields: {sorted(known)}")


def read_version(owner: str, values: dict, version: int) -> None:
    """Pop the format `version` of a saved dict (absent: read as this one) and refuse another."""
    saved = values.pop("version", version)
    if type(saved) is not int or saved != version:
        raise ValueError(f"{owner}.from_dict: format version {saved!r} is not one this slimfit reads ({version}): "
                         "written by another slimfit version; upgrade slimfit, or build the config again from "
                         "its fields")


# ---------------------------------------------------------------------------------------------- files
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


class ConfigBase:
    """A config saved beside a checkpoint: a subclass gives CONFIG_NAME (its JSON file), CONFIG_VERSION (the
    format of its to_dict, bumped when a saved field changes meaning), to_dict() and from_dict(values,
    **changes); save_pretrained / from_pretrained are the same for both configs."""

    CONFIG_NAME: ClassVar[str]
    CONFIG_VERSION: ClassVar[int] = 1

    def to_dict(self) -> dict:
        raise NotImplementedError

    @classmethod
    def from_dict(cls, values, /, **changes):
        raise NotImplementedError

    def save_pretrained(self, save_directory) -> str:
        """Write the config as JSON to `save_directory`/CONFIG_NAME (beside a model's save_pretrained files
        or a checkpoint; the folder made if needed); returns the file's path."""
        return save_json(self.to_dict(), save_directory, self.CONFIG_NAME)

    @classmethod
    def from_pretrained(cls, path, /, **changes):
        """The config save_pretrained wrote (a directory holding CONFIG_NAME, or the file), read by from_dict
        with `changes` applied (a format version this slimfit does not read is refused)."""
        return cls.from_dict(load_json(path, cls.CONFIG_NAME, cls.__name__), **changes)
