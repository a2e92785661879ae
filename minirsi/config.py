"""Typed configs: dataclasses loaded from YAML and overridden from the command line.

Every stage of minirsi is configured by a plain ``@dataclass`` whose fields carry a
docstring (the paper's symbol where there is one) and whose ``__post_init__`` rejects bad
values with a message that says the fix. This module is the one place that turns YAML files
and ``key=value`` overrides into such a dataclass, using OmegaConf's structured configs so
that an unknown key or a value of the wrong type is an error that names the key::

    cfg = load_config(RPRConfig, "presets/toy-cpu.yaml", ["lr_actor=1e-4", "ppo_epochs=2"])

Nested dataclasses are addressed with dots (``rpr1.lr_actor=1e-4``).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Sequence, TypeVar

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from minirsi.core.atomic import atomic_write_text

T = TypeVar("T")


class ConfigError(ValueError):
    """A config file or override that cannot be used; the message names the key and the fix."""


def load_config(
    cls: type[T],
    path: str | Path | None = None,
    overrides: Sequence[str] = (),
    *,
    section: str | None = None,
) -> T:
    """Build ``cls`` from its defaults, then a YAML file, then ``key=value`` overrides.

    Args:
        cls: a dataclass type.
        path: optional YAML file; ``section`` picks a top-level mapping inside it.
        overrides: dotlist strings such as ``"lr_actor=1e-5"``; later ones win.
    Raises:
        ConfigError: unknown key, wrong type, unreadable file, or a ``__post_init__`` rejection,
            with the file / key in the message.
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"load_config needs a dataclass type, got {cls!r}")
    where = "defaults"
    try:
        merged = OmegaConf.structured(cls)
        if path is not None:
            where = str(path)
            data = _read_yaml(Path(path))
            if section is not None:
                if section not in data:
                    raise ConfigError(f"{path}: no top-level section '{section}' (has: {sorted(data)})")
                data = data[section] or {}
            merged = OmegaConf.merge(merged, OmegaConf.create(data))
        for item in overrides:
            where = f"override '{item}'"
            if "=" not in item:
                raise ConfigError(f"{where}: expected key=value, e.g. lr_actor=1e-5")
            merged = OmegaConf.merge(merged, OmegaConf.from_dotlist([item]))
        return OmegaConf.to_object(merged)  # runs __post_init__ of every nested dataclass
    except OmegaConfBaseException as e:
        raise ConfigError(f"{where}: {_first_line(e)} (valid keys: {_keys(cls)})") from None
    except ValueError as e:
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{where}: {e}") from None


def to_dict(cfg: Any) -> dict:
    """A plain dict of a (nested) dataclass instance, for saving next to a run."""
    return dataclasses.asdict(cfg)


def save_config(cfg: Any, path: str | Path) -> None:
    """``cfg`` as YAML, atomically (a resume reads it back with ``load_config``)."""
    atomic_write_text(path, yaml.safe_dump(to_dict(cfg), sort_keys=False))


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(f"{path}: config file not found")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of key: value")
    return data


def _keys(cls: type) -> str:
    return ", ".join(f.name for f in dataclasses.fields(cls))


def _first_line(e: Exception) -> str:
    return str(e).strip().splitlines()[0]
