"""The training recipe for CALM and its baselines, one readable loop (in the manner of torchtune's recipes).

    setup()      model -> LoRA on the top layers -> encoded data -> α head -> optimizer, in that order because
                 each needs the one before (LoRA wraps the model; encoding needs the frozen layers; the optimizer
                 needs every parameter)
    train()      the loop: one step of the configured method per step, logging, periodic evaluation, checkpoints
    save_checkpoint() / resume   everything needed to continue bit-for-bit: weights, α, optimizer, data position
    export()     the artifact: LoRA adapter, α head, manifest with metrics and reference histograms

The step functions live in training/methods.py, one typed registry entry per method (step, whether α is trained,
the head it needs): no chain of elifs and no lookup by name.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from calm_core.scoring import option_probs
from calm_core.artifact import DataRef, ReferenceHistogram, load_artifact, save_artifact
from calm_core.errors import ConfigError
from calm_core.metrics import calibration_report, top_label
from calm_core.models import model_weights_sha256, resolve_model
from calm_core.paths import calm_home
from calm_core.splits import load_split, materialize
from training.alpha_params import AlphaParams
from training.answer_formats import answer_format
from training.artifacts import domain_groups, model_refs, reference_histogram
from training.config import TrainConfig
from training.features import Batch, BatchStream, EncodedSet, concat, encode_sets
from training.generative import answer_nll, calibration_answers, gold_target
from training.method_specs import SPECS
from training.methods import STEPS
from training.objectives import mask_options
from training.scoring import load_causal_lm, load_tokenizer
from training.top_layers import enable_checkpointing

log = logging.getLogger("calm.train")
CHECKPOINT = "checkpoint.pt"
# What may differ between a checkpoint and the run that resumes it: running longer or logging differently.
RESUMABLE_CHANGES = {"steps", "eval_every", "checkpoint_every", "out_dir"}


class Trainer:
    def __init__(self, cfg: TrainConfig, show_progress: bool = True):
        self.cfg = cfg
        self.out = Path(cfg.out_dir)
        self.show_progress = show_progress
        self.step = 0
        self.history: list[dict] = []
        self._memo_step = -1
        self._memo: dict[int, np.ndarray] = {}

    # -- setup ---------------------------------------------------------------------------------------------------
    def setup(self) -> "Trainer":
        from accelerate import Accelerator

        cfg = self.cfg
        # Under `accelerate launch` each process trains on its own batches and the step directions are averaged
        # (`_apply`); BOME combines gradients by hand, so DDP's backward hooks could not do that averaging.
        self.accelerator = Accelerator(cpu=not torch.cuda.is_available())
        self.device = self.accelerator.device
        _seed_everything(cfg.seed)
        self.resolved = resolve_model(cfg.model)
        self.tokenizer = load_tokenizer(self.resolved.path)
        self.model = self._lora_model(load_causal_lm(self.resolved.path, cfg.dtype)).to(self.device)
        self.first_trained = self.model.get_base_model().config.num_hidden_layers - cfg.lora_top_layers
        if cfg.gradient_checkpointing:
            enable_checkpointing(self.model, self.first_trained)
        self.split = materialize(load_split(cfg.split))
        if self.split.config.open_ended != (cfg.answer_format == "generative"):
            raise ConfigError(f"split {cfg.split} is {'open-ended' if self.split.config.open_ended else 'multiple choice'}"
                              f"; answer_format {cfg.answer_format!r} does not fit it (open-ended splits need 'generative')")
        self.fmt = answer_format(cfg.answer_format, self.tokenizer, self._answer_targets() if self.split.config.open_ended else None)
        self.sets = encode_sets(self.model, self.tokenizer, self.split, self.first_trained,
                                self.weights_id, calm_home() / "cache", self.fmt,
                                cfg.encode_batch_size)
        self.train_set = concat(list(self.sets["train"].values()), "train")
        self.calib_set = concat(list(self.sets["calibration"].values()), "calibration")
        self.tracked_tokens = self.fmt.tracked_tokens(self.train_set.items).to(self.device)
        self.vocab_size = int(self.model.get_base_model().config.vocab_size)
        self.alpha = AlphaParams(self.vocab_size, scalar=cfg.head == "scalar").to(self.device)
        if cfg.init_from:
            self._init_from(Path(cfg.init_from))
        self.theta = [p for p in self.model.parameters() if p.requires_grad]
        groups = [{"params": self.theta, "lr": cfg.lr_theta}]
        if SPECS[cfg.method].trains_alpha:
            groups.append({"params": self.alpha.trainable(), "lr": cfg.lr_alpha})
        self.optimizer = torch.optim.Adam(groups)
        rank = self.accelerator.process_index
        self.train_stream = BatchStream(self.train_set, cfg.batch_size, cfg.seed + 7919 * rank)
        self.calib_stream = BatchStream(self.calib_set, cfg.batch_size, cfg.seed + 1 + 7919 * rank)
        self.cft_bins = self._initial_bin_accuracy() if cfg.method == "cft" else None
        return self

    @property
    def weights_id(self) -> str:
        """What cached encodings are keyed by: the weights, and their dtype where it is not float32."""
        digest = model_weights_sha256(self.resolved)
        return digest if self.cfg.dtype == "float32" else f"{digest}-{self.cfg.dtype}"

    def _init_from(self, path: Path) -> None:
        """θ and α from an artifact (its adapter and head), refused unless its LoRA has this config's shape."""
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        artifact = load_artifact(path)
        if artifact.adapter_dir is None:
            raise ConfigError(f"init_from {path}: the artifact has no LoRA adapter to start from")
        saved = json.loads((artifact.adapter_dir / "adapter_config.json").read_text())
        ours = self.model.peft_config["default"]
        theirs = (saved["r"], float(saved["lora_alpha"]), sorted(saved["layers_to_transform"]), sorted(saved["target_modules"]))
        mine = (ours.r, float(ours.lora_alpha), sorted(ours.layers_to_transform), sorted(ours.target_modules))
        if theirs != mine:
            raise ConfigError(f"init_from {path}: its adapter (rank, alpha, layers, modules) {theirs} differs from this "
                              f"config's {mine}")
        if (artifact.head.kind.value == "scalar") != self.alpha.scalar:
            raise ConfigError(f"init_from {path}: a {artifact.head.kind.value} head cannot start a {self.cfg.head} one")
        loaded = set_peft_model_state_dict(self.model, load_file(str(artifact.adapter_dir / "adapter_model.safetensors")))
        if getattr(loaded, "unexpected_keys", None):
            raise ConfigError(f"init_from {path}: adapter tensors this model does not have: {loaded.unexpected_keys[:3]}")
        start = AlphaParams.from_head(artifact.head)
        with torch.no_grad():
            self.alpha.log_scale.copy_(start.log_scale.to(self.device))
            self.alpha.shift.copy_(start.shift.to(self.device))

    def _answer_targets(self) -> dict[str, tuple[int, ...]]:
        """Free form: the gold answer of every labelled question; the model's own greedy answer to every calibration
        prompt (its labels are never read)."""
        targets = {q.id: gold_target(self.tokenizer, q) for role in ("train", "test_in_domain", "test_out_of_domain")
                   for q in self.split.role(role)}
        with self.model.disable_adapter():
            targets.update(calibration_answers(self.model, self.tokenizer, self.split.role("calibration"),
                                               self.cfg.calibration_answers, calm_home() / "cache", self.weights_id,
                                               self.out if self.accelerator.is_main_process else None))
        return targets

    def _lora_model(self, model):
        from peft import LoraConfig, get_peft_model

        layers = model.config.num_hidden_layers
        lora = LoraConfig(r=self.cfg.lora_rank, lora_alpha=self.cfg.lora_alpha, target_modules=self.cfg.lora_targets,
                          layers_to_transform=list(range(layers - self.cfg.lora_top_layers, layers)), lora_dropout=0.0)
        return get_peft_model(model, lora)

    # -- forward pieces --------------------------------------------------------------------------------------------
    def forward(self, batch: Batch):
        """The trained top layers on a batch, before α (what the answer format needs to apply α afterwards)."""
        return self.fmt.forward(self.model, batch.items, self.first_trained, batch.width, self.device)

    def calibrated(self, raw, batch: Batch) -> torch.Tensor:
        """(B, width) calibrated option logits, -inf past each question's options (multiple choice)."""
        return mask_options(self.fmt.option_logits(raw, self.alpha), batch.n_options.to(self.device))

    def g(self, batch: Batch, raw=None, smoothing: float = 0.0) -> torch.Tensor:
        """Lower level: CE of the gold answer (option, or answer tokens) under the calibrated distribution."""
        raw = self.forward(batch) if raw is None else raw
        return self.fmt.loss(raw, self.alpha, batch.labels.to(self.device), batch.n_options, smoothing)

    def f(self, batch: Batch) -> torch.Tensor:
        """Upper level: minus the mean predictive entropy on unlabelled calibration questions."""
        return -self.fmt.upper_entropy(self.forward(batch), self.alpha, batch.n_options, self.cfg.entropy_over).mean()

    # -- applying a step ------------------------------------------------------------------------------------------
    def apply(self, params: list[torch.nn.Parameter], grads: list[torch.Tensor]) -> None:
        """Set these gradients (averaged across processes) and step the optimizer; other parameters stay put."""
        for p, gr in zip(params, grads):
            gr = gr.detach().clone()
            p.grad = self.accelerator.reduce(gr, "mean") if self.accelerator.num_processes > 1 else gr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    # -- the loop ------------------------------------------------------------------------------------------------
    def train(self) -> None:
        cfg = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        step = STEPS[cfg.method]
        main = self.accelerator.is_main_process
        # A run from step 0 starts its log over (--no-resume, or a report's row restarted); a resumed run continues it.
        metrics_log = open(self.out / "train_log.jsonl" if main else os.devnull, "a" if self.step else "w")
        columns = (TextColumn(f"{cfg.method} seed {cfg.seed}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("{task.fields[info]}"))
        with Progress(*columns, disable=not (self.show_progress and main)) as bar:
            task = bar.add_task("train", total=cfg.steps, completed=self.step, info="")
            while self.step < cfg.steps:
                start = time.perf_counter()
                record = step(self)
                self.step += 1
                record.update(step=self.step, seconds=time.perf_counter() - start,
                              alpha_scale_mean=float(self.alpha.rows(self.tracked_tokens)[0].detach().mean()))
                if cfg.eval_every and (self.step % cfg.eval_every == 0 or self.step == cfg.steps):
                    record.update({f"val_{k}": v for k, v in self.quick_eval().items()})
                self.history.append(record)
                metrics_log.write(json.dumps(record) + "\n")
                metrics_log.flush()
                bar.update(task, advance=1, info=f"g {record['g']:.3f}" + (f" λ {record['lambda']:.2f}" if "lambda" in record else ""))
                if self.step % cfg.checkpoint_every == 0 or self.step == cfg.steps:
                    self.save_checkpoint()
        metrics_log.close()

    # -- evaluation ----------------------------------------------------------------------------------------------
    @torch.no_grad()
    def option_logits(self, data: EncodedSet, batch_size: int = 32) -> np.ndarray:
        """(N, width) calibrated option logits of a whole set under the current θ and α; memoised per step
        (evaluation, post-hoc fits and export share it)."""
        if self._memo_step != self.step:
            self._memo_step, self._memo = self.step, {}
        if id(data) not in self._memo:
            order = sorted(range(len(data)), key=lambda i: len(data.items[i]))  # little padding per batch
            z = torch.empty(len(data), data.width, dtype=torch.float64)
            for start in range(0, len(order), batch_size):
                idx = order[start : start + batch_size]
                raw = self.fmt.forward(self.model, [data.items[i] for i in idx], self.first_trained, data.width,
                                       self.device)
                z[idx] = self.fmt.option_logits(raw, self.alpha).double().cpu()
            self._memo[id(data)] = z.numpy()
        return self._memo[id(data)]

    def probs(self, data: EncodedSet) -> np.ndarray:
        return option_probs(self.option_logits(data), data.n_options.numpy())

    def quick_eval(self) -> dict:
        if self.fmt.generative:
            return self.free_form_quick_eval()
        # Captured calibration prompts carry no answers: then the first in-domain test set shows progress instead.
        labelled = all(s.labelled for s in self.split.config.calibration)
        data = self.calib_set if labelled else next(iter(self.sets["test_in_domain"].values()))
        probs = self.probs(data)
        conf, correct = top_label(probs, data.labels.numpy())
        return {"accuracy": float(correct.mean()), "mean_conf": float(conf.mean())}

    @torch.no_grad()
    def free_form_quick_eval(self, batch_size: int = 32) -> dict:
        """Mean calibrated NLL of the gold answers of the first in-domain test set, and the calibration entropy."""
        out = {}
        for key, data, fn in (("gold_nll", next(iter(self.sets["test_in_domain"].values())), answer_nll),
                              ("calib_entropy", self.calib_set, None)):
            values = []
            for start in range(0, len(data), batch_size):
                raw = self.fmt.forward(self.model, data.items[start : start + batch_size], self.first_trained, 1, self.device)
                values.append(fn(raw, self.alpha) if fn else self.fmt.upper_entropy(raw, self.alpha, None, "vocab"))
            out[key] = float(torch.cat(values).mean())
        return out

    def evaluate(self) -> dict[str, dict]:
        """Metrics on every test source, keyed 'in_domain/<label>' and 'out_of_domain/<label>'."""
        results = {}
        for role, prefix in (("test_in_domain", "in_domain"), ("test_out_of_domain", "out_of_domain")):
            for label, data in self.sets[role].items():
                report = calibration_report(self.probs(data), data.labels.numpy(), n_boot=100, seed=self.cfg.seed)
                results[f"{prefix}/{label}"] = report.as_dict()
        return results

    # -- checkpoints -----------------------------------------------------------------------------------------------
    def save_checkpoint(self) -> None:
        if not self.accelerator.is_main_process:
            return
        state = {
            "step": self.step, "config": self.cfg.model_dump(mode="json"),  # plain values: read with weights_only
            "theta": [p.detach().clone() for p in self.theta], "alpha": self.alpha.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "streams": {"train": self.train_stream.state(), "calib": self.calib_stream.state()},
            "rng": {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": _numpy_rng_state()},
            "history": json.loads(json.dumps(self.history)),  # plain floats: numpy ones do not load as weights only
        }
        tmp = self.out / f"{CHECKPOINT}.{os.getpid()}.tmp"
        torch.save(state, tmp)
        os.replace(tmp, self.out / CHECKPOINT)  # a kill mid-write leaves the previous checkpoint intact

    def resume(self, restart_if_mismatched: bool = False) -> bool:
        """Continue from the checkpoint in `out_dir`, if there is one. Only a few settings may change in between
        (more steps extend a run). A checkpoint this configuration cannot continue — another configuration, or
        already past its `steps` — is refused, or with `restart_if_mismatched` (a report's rows, which must each
        be a run of the report's configuration) removed, so that the run starts over."""
        path = self.out / CHECKPOINT
        if not path.is_file():
            return False
        state, problem = _read_checkpoint(path)
        now = self.cfg.model_dump(mode="json")
        saved = state["config"] if state is not None else now
        changed = sorted(k for k in set(saved) | set(now) if saved.get(k) != now.get(k))
        if state is not None and set(changed) - RESUMABLE_CHANGES:
            problem = f"was written by a different configuration ({', '.join(changed)})"
        elif state is not None and state["step"] > self.cfg.steps:
            problem = f"is at step {state['step']}, past the configured {self.cfg.steps} steps"
        if problem and restart_if_mismatched:
            log.warning("%s %s: starting this run over", path, problem)
            path.unlink()
            return False
        if problem:
            raise ConfigError(f"{path} {problem}; use another out_dir or --no-resume")
        if changed:
            log.warning("resuming with a changed config (%s)", ", ".join(changed))
        with torch.no_grad():
            for p, saved in zip(self.theta, state["theta"]):
                p.copy_(saved)
        self.alpha.load_state_dict(state["alpha"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.train_stream.load(state["streams"]["train"])
        self.calib_stream.load(state["streams"]["calib"])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        np.random.set_state(_numpy_rng_from(state["rng"]["numpy"]))
        self.step, self.history = state["step"], state["history"]
        return True

    # -- output ----------------------------------------------------------------------------------------------------
    def export(self, metrics: dict[str, dict] | None = None, merged: bool = False) -> Path:
        path = self.out / "artifact"
        if not self.accelerator.is_main_process:
            return path
        generative = self.fmt.generative
        # Free-form metrics and reference histograms need generated answers: `calm eval --artifact` and the open-ended
        # report add them (training/free_form_eval.py); multiple choice computes both here.
        metrics = metrics if metrics is not None else ({} if generative else self.evaluate())
        base, tok = model_refs(self.resolved, self.tokenizer, self.vocab_size)
        histograms = {} if generative else self.reference_histograms()
        flat = {k: {m: float(v) for m, v in d.items() if isinstance(v, (int, float))} for k, d in metrics.items()}
        data = [DataRef(name=f"{role}:{label}", sha256=_ids_hash(s.questions))
                for role in ("train", "calibration") for label, s in self.sets[role].items()]
        with tempfile.TemporaryDirectory() as tmp:
            self.model.save_pretrained(tmp)
            # The adapter names its base by model id, not by this machine's path; peft's empty model card is dropped.
            config_path = Path(tmp, "adapter_config.json")
            config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "base_model_name_or_path": base.id}, indent=2))
            Path(tmp, "README.md").unlink(missing_ok=True)
            save_artifact(path, self.alpha.to_head(), base_model=base, tokenizer=tok, method=self.cfg.method,
                          training_data=data, metrics=flat, reference_histograms=histograms, adapter_dir=tmp,
                          answer_format=self.cfg.answer_format,
                          applies_to="free_form" if generative else "multiple_choice")
        (self.out / "config.json").write_text(self.cfg.model_dump_json(indent=2))
        if merged:
            self.write_merged(self.out / "merged")
        return path

    def reference_histograms(self) -> dict[str, ReferenceHistogram]:
        """Calibrated confidences on held-out questions (in-domain tests and calibration), per serving domain."""
        held_out = [d for role in ("calibration", "test_in_domain", "test_out_of_domain") for d in self.sets[role].values()]
        confidence = np.concatenate([self.probs(d).max(axis=1) for d in held_out])
        questions = [q for d in held_out for q in d.questions]
        return {domain: reference_histogram(confidence[idx]) for domain, idx in domain_groups(questions).items()}

    def write_merged(self, path: Path) -> Path:
        """Base weights with the LoRA adapter merged in: a plain HF folder that vLLM loads on CPU and GPU."""
        merged = self.model.merge_and_unload()
        merged.save_pretrained(path, safe_serialization=True)
        self.tokenizer.save_pretrained(path)
        return path

    def _initial_bin_accuracy(self) -> torch.Tensor:
        """CFT's bin accuracies, from the initial model on the labelled training set."""
        probs = self.probs(self.train_set)
        conf, correct = top_label(probs, self.train_set.labels.numpy())
        bins = self.cfg.cft_bins
        idx = np.minimum((conf * bins).astype(int), bins - 1)
        acc = [correct[idx == b].mean() if (idx == b).any() else (b + 0.5) / bins for b in range(bins)]
        return torch.tensor(acc, dtype=torch.float32, device=self.device)


def _ids_hash(questions) -> str:
    import hashlib

    return hashlib.sha256("\n".join(q.id for q in questions).encode()).hexdigest()


def _read_checkpoint(path: Path) -> tuple[dict | None, str | None]:
    """The checkpoint's state, or why it cannot be read: tensors and plain values only, since a checkpoint is data and
    a full unpickler would run whatever code a file names (checkpoints written before this rule hold numpy arrays)."""
    try:
        return torch.load(path, weights_only=True), None
    except pickle.UnpicklingError:
        return None, "holds more than tensors and plain values"


def _numpy_rng_state() -> dict:
    """numpy's global generator state as plain values (its own holds an array, which a weights-only load refuses)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"name": name, "keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss), "cached": float(cached)}


def _numpy_rng_from(state: dict) -> tuple:
    return (state["name"], np.asarray(state["keys"], dtype=np.uint32), state["pos"], state["has_gauss"], state["cached"])


def _seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
