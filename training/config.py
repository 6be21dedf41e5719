"""Typed training configuration, read from TOML; every default lives here."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from calm_core.toml_config import load_toml_model
from calm_core.prompts import AnswerFormat
from training.method_specs import METHOD_NAMES, SPECS

Method = Literal[METHOD_NAMES]  # the registry's names (a tuple subscript is the Literal of its items)


class TrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    method: Method = "calm"
    model: str | None = None  # None = embedded default
    split: str = "configs/splits/science.toml"
    seed: int = 0
    out_dir: str = "runs/calm"
    # cloze: options scored by their text's length-normalised log-likelihood (α on every token of it);
    # letter: one letter at the answer position (stays at chance at 135M parameters);
    # generative: free-form answers (open-ended splits), the answer's tokens after the chat-templated question.
    answer_format: AnswerFormat = AnswerFormat.CLOZE

    # Start θ (the LoRA adapter) and α (the head) from this artifact instead of zero and identity: the retraining
    # worker continues from the version serving the domain. Its adapter must have this config's LoRA shape.
    init_from: str | None = None
    # Free form: a JSON file of calibration question id -> the token ids of the greedy answer an engine served on the
    # weights this run starts from (a retraining job passes its active mode's, judged before training anyway). Those
    # are the upper level's answers; a question the file lacks gets the base model's, generated as without the file.
    calibration_answers: str | None = None

    # LoRA on the top decoder layers only (their input is cached once per prompt).
    lora_rank: int = Field(16, gt=0)
    lora_alpha: float = 32.0
    lora_targets: list[str] = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    lora_top_layers: int = Field(4, gt=0)

    # The frozen weights' dtype: bfloat16 halves their memory (what a 7-8B model needs on one GPU: docs/training.md);
    # the LoRA adapter, the α head, the optimizer state and the losses stay float32.
    dtype: Literal["float32", "bfloat16"] = "float32"
    # Recompute each trained layer's activations in the backward pass instead of keeping them: pays where many layers
    # are trained on long prompts (benchmarks/loop/bench_training_memory.py measures what it saves).
    gradient_checkpointing: bool = False

    steps: int = Field(200, gt=0)
    batch_size: int = Field(8, gt=0)
    lr_theta: float = Field(5e-4, gt=0)
    lr_alpha: float = Field(2e-2, gt=0)

    # CALM (BOME first-order bilevel): T inner SGD steps on g, then the coupled step along ∇f + λ∇q.
    inner_steps: int = Field(1, ge=1)
    inner_lr: float = Field(5e-3, gt=0)
    eta: float = Field(0.5, gt=0)
    entropy_over: Literal["options", "vocab"] = "options"
    head: Literal["vector", "scalar"] = "vector"

    # Baselines.
    label_smoothing: float = Field(0.1, ge=0, lt=1)
    cft_weight: float = Field(1.0, ge=0)
    cft_bins: int = Field(10, gt=0)
    reg_weight: float = Field(0.1, ge=0)

    # 0: no quick evaluation (a retraining job's free-form stage scores its candidate as served after training).
    eval_every: int = Field(50, ge=0)
    checkpoint_every: int = Field(25, gt=0)
    encode_batch_size: int = Field(16, gt=0)

    @model_validator(mode="after")
    def _consistent(self):
        spec = SPECS[self.method]
        if spec.head is not None:
            self.head = spec.head
        if self.answer_format == AnswerFormat.GENERATIVE:
            if not spec.free_form:
                raise ValueError(f"method {self.method!r} does not apply to free-form answers")
            self.entropy_over = "vocab"  # free-form answers have no options: the entropy is the vocabulary's
        return self


def load_config(path: str | Path, **overrides) -> TrainConfig:
    return load_toml_model(path, TrainConfig, "training config", **overrides)
