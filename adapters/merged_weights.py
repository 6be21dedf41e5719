"""An artifact's LoRA adapter merged into the base weights once, as a plain HF folder that vLLM loads on CPU and GPU
alike, cached by artifact version: the in-process gateway serves adapter requests from a second engine on it."""

from __future__ import annotations

from pathlib import Path

from calm_core.artifact import LoadedArtifact
from calm_core.atomic import atomic_dir
from calm_core.paths import calm_home


def merged_model_dir(base_model_path: str, artifact: LoadedArtifact, home: Path | None = None) -> Path:
    """The folder to serve: the base model itself when the artifact has no adapter, else base+adapter merged."""
    if artifact.adapter_dir is None:
        return Path(base_model_path)
    target = (home or calm_home()) / "merged" / f"{artifact.manifest.artifact_version}-{artifact.manifest.head_sha256[:8]}"
    if (target / "config.json").is_file():
        return target
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(base_model_path, dtype=torch.float32)
    merged = PeftModel.from_pretrained(base, str(artifact.adapter_dir)).merge_and_unload()
    with atomic_dir(target) as tmp:
        merged.save_pretrained(tmp, safe_serialization=True)
        AutoTokenizer.from_pretrained(base_model_path).save_pretrained(tmp)
    return target
