"""Typed configs from TOML files: one reader, so every config fails the same way (one line naming the file, the field
and what is wrong)."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel, ValidationError

from calm_core.errors import ConfigError

M = TypeVar("M", bound=BaseModel)


def load_toml_model(path: str | Path, config_type: type[M], what: str, **overrides) -> M:
    """`config_type` validated from the TOML file at `path`, with `overrides` (those not None) replacing its values."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{what} not found: {path}")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path}: invalid TOML ({e})") from None
    data.update({k: v for k, v in overrides.items() if v is not None})
    try:
        return config_type.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        raise ConfigError(f"{path}: {'.'.join(map(str, err['loc']))}: {err['msg']}") from None
