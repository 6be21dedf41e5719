"""Served copies of the weights, built once per artifact as plain HF folders that vLLM loads on CPU and GPU alike:

- merged: the artifact's LoRA adapter merged into the base weights (the in-process gateway serves adapter requests
  from a second engine on it);
- folded: the same, with the α head's scales folded into the LM head's rows (row v times d_v), so that the model's
  own logits are the calibrated ones, d ⊙ z. Exact whenever the shifts l are one constant (a constant shift does not
  change a softmax): scalar heads and per-token scale-only heads. Then vLLM's prompt log-probs, which skip logits
  processors, are calibrated, and a cloze option is scored in one request.

A copy is named by what its weights are made of (served_weights_key): versions with the same adapter (a recalibrated
version, a retrained free-form mode beside its parent's multiple-choice mode) share one copy, hence one engine.
Each copy carries an index of its files' hashes (CACHE_INDEX), written last; a copy is served only when every file
matches it (hashed once per process), else it is built again: a crash, a disk fault or an edit never reaches an engine.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
from pathlib import Path

import numpy as np

from calm_core.alpha_head import AlphaHead
from calm_core.artifact import ADAPTER_DIR, LoadedArtifact
from calm_core.atomic import atomic_dir
from calm_core.hashing import folder_index, index_mismatch
from calm_core.paths import calm_home
from calm_core.startup import stage

CACHE_INDEX = "calm-cache.json"
log = logging.getLogger("calm.engine")


def write_cache_index(folder: Path) -> None:
    """The hashes of every file a copy holds: the last file written into it."""
    (folder / CACHE_INDEX).write_text(json.dumps({"files": folder_index(folder)}))


def cache_ready(folder: Path) -> bool:
    """Whether a cached copy is whole and as built: its weights' config and every file of its index, unchanged."""
    if not (folder / "config.json").is_file():
        return False  # not built (a folder without config.json is a copy cut short)
    try:
        index = json.loads((folder / CACHE_INDEX).read_text())["files"]
        bad = "config.json (not indexed)" if "config.json" not in index else index_mismatch(folder, index)
    except (OSError, ValueError, KeyError, TypeError):
        bad = f"{CACHE_INDEX} (missing or unreadable)"
    if bad is not None:
        log.warning("%s: %s; building it again", folder, bad)
    return bad is None


def _build_into(target: Path):
    """A folder to build a copy in: a copy another process finishes first is kept (an engine may be reading it), one
    that is there now but failed its check is replaced."""
    return atomic_dir(target, keep_existing=not target.exists())


def served_weights_key(artifact: LoadedArtifact) -> str:
    """What a version's served weights are made of: the base model's weights and the adapter's files (their hashes, as
    its manifest records them). A manifest that records none (written before files were recorded): its version."""
    adapter = sorted((name, digest) for name, digest in (artifact.manifest.files or {}).items()
                     if name.startswith(f"{ADAPTER_DIR}/"))
    if not adapter:
        return artifact.manifest.artifact_version
    made_of = json.dumps([artifact.manifest.base_model.weights_sha256, adapter]).encode()
    return "adapter-" + hashlib.sha256(made_of).hexdigest()[:16]


def _merged_target(artifact: LoadedArtifact, home: Path | None) -> Path:
    return (home or calm_home()) / "merged" / served_weights_key(artifact)


def built_merged_dir(base_model_path: str, artifact: LoadedArtifact, home: Path | None = None) -> Path | None:
    """The folder to serve if nothing needs building: the base model when the artifact has no adapter, or the merged
    copy a gateway (or an earlier call) left in `home`'s cache; None when the merge has not been done."""
    if artifact.adapter_dir is None:
        return Path(base_model_path)
    target = _merged_target(artifact, home)
    return target if cache_ready(target) else None


def merged_model_dir(base_model_path: str, artifact: LoadedArtifact, home: Path | None = None) -> Path:
    """The folder to serve: the base model itself when the artifact has no adapter, else base+adapter merged."""
    built = built_merged_dir(base_model_path, artifact, home)
    if built is not None:
        return built
    target = _merged_target(artifact, home)
    stage(f"merging version {artifact.manifest.artifact_version}'s adapter into a copy of the weights (once)")
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_model_path, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(artifact.adapter_dir)).merge_and_unload()
    with _build_into(target) as tmp:
        merged.save_pretrained(tmp, safe_serialization=True)
        copy_tokenizer(base_model_path, tmp)
        write_cache_index(tmp)
    return target


# A tokenizer's files as transformers saves them (the fast tokenizer, its config, a slow tokenizer's vocabularies, the
# chat template).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model", "chat_template.jinja",
                   "chat_template.json")


def copy_tokenizer(base_model_path: str | Path, out: Path) -> None:
    """The base model's tokenizer beside a copy of its weights, file by file. Not loaded and saved again: a load holds
    the GIL for most of a second (the Rust tokenizer is built under it), which stalled a serving gateway's event loop
    while it prepared a promoted version (benchmarks/engines/bench_hot_swap.py); the saved files were byte-identical anyway.
    A model whose tokenizer has none of these files is loaded and saved as before."""
    found = [Path(base_model_path) / name for name in TOKENIZER_FILES if (Path(base_model_path) / name).is_file()]
    if not any(f.name in ("tokenizer.json", "tokenizer_config.json") for f in found):
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(base_model_path).save_pretrained(out)
        return
    for source in found:
        shutil.copy2(source, out / source.name)


def foldable(head: AlphaHead) -> bool:
    """Whether d ⊙ z + l can live in the LM head's weights: l must be the same for every token."""
    return bool(np.all(head.shift == head.shift[0]))


def folded_model_dir(base_model_path: str, artifact: LoadedArtifact, home: Path | None = None) -> Path:
    """Base (+ adapter merged) with LM-head row v scaled by d_v; tied input embeddings are untied first."""
    if not foldable(artifact.head):
        raise ValueError(f"artifact {artifact.manifest.artifact_version} has per-token shifts: its head cannot be folded")
    target = (home or calm_home()) / "folded" / f"{served_weights_key(artifact)}-{artifact.manifest.head_sha256[:8]}"
    if cache_ready(target):
        return target
    import torch
    from transformers import AutoModelForCausalLM

    source = merged_model_dir(base_model_path, artifact, home)
    stage(f"folding version {artifact.manifest.artifact_version}'s head into the LM head for one-pass scoring (once)")
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    scale = torch.as_tensor(artifact.head.scale, dtype=torch.float32)[:, None]
    with torch.no_grad():
        weight = model.get_output_embeddings().weight.detach().clone() * scale
        model.config.tie_word_embeddings = False
        if hasattr(model.config, "get_text_config"):
            model.config.get_text_config().tie_word_embeddings = False
        model.lm_head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        model.lm_head.weight = torch.nn.Parameter(weight)
    with _build_into(target) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        copy_tokenizer(base_model_path, tmp)
        write_cache_index(tmp)
    return target
