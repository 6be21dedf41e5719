"""Typed configs from TOML files: one reader, so every config fails the same way (one line naming the file, the field
and what is wrong)."""

from __future__ import annotations

import json
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


def dump_toml(data: dict) -> str:
    """A flat config as TOML that `load_toml_model` reads back: top-level values (numbers, strings, booleans, lists
    of those) first, then each list of tables (a split's sources) as `[[name]]` blocks. JSON's literals are TOML's for
    these types."""
    tables = {k: v for k, v in data.items() if isinstance(v, list) and v and all(isinstance(x, dict) for x in v)}
    lines = [f"{k} = {json.dumps(v)}" for k, v in data.items() if k not in tables]
    for name, rows in tables.items():
        for row in rows:
            lines += [f"\n[[{name}]]", *(f"{k} = {json.dumps(v)}" for k, v in row.items())]
    return "\n".join(lines) + "\n"
