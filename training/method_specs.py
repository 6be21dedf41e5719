"""Every training method's name and what it trains (plain data, importable without torch: the training config
validates its `method` against these names); training/methods.py holds each method's step."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class MethodSpec:
    name: str
    trains_alpha: bool
    trains_theta: bool = True
    head: Literal["vector", "scalar"] | None = None  # the head the method needs; None: the config's `head`
    free_form: bool = True  # applies to free-form answers (CFT's binned accuracies need options)


SPECS: dict[str, MethodSpec] = {spec.name: spec for spec in (
    MethodSpec("sft", trains_alpha=False),
    MethodSpec("label_smoothing", trains_alpha=False),
    MethodSpec("cft", trains_alpha=False, free_form=False),
    MethodSpec("regularization", trains_alpha=True),
    MethodSpec("iterate", trains_alpha=True),
    MethodSpec("calm", trains_alpha=True),
    MethodSpec("calm_scalar", trains_alpha=True, head="scalar"),
    # CALM with θ held: the retraining loop's label-free job (docs/retraining-loop.md, "What a label-free job changes").
    MethodSpec("calm_head", trains_alpha=True, trains_theta=False, head="scalar"),
)}
METHOD_NAMES: tuple[str, ...] = tuple(SPECS)
