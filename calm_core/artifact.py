"""The α-head artifact: the contract between training and serving.

Layout of an artifact folder:
    alpha_head.safetensors   tensors `scale` (d) and `shift` (l), float32, shape (V,) or (1,)
    manifest.json            ArtifactManifest below
    adapter/                 optional LoRA adapter (peft format) trained with the head
Writes are atomic and durable (a temporary sibling folder, fsynced, renamed into place); loading verifies the hash of
every file the manifest records (the head's, the adapter's; a free-form mode's own manifest its files), the head's
shapes and, when told what it is applied to, the base model's weights hash, the tokenizer hash and the vocabulary size.
"""

from __future__ import annotations

import json
import re
import shutil
import uuid
from datetime import datetime, timezone
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
from pydantic import AfterValidator, BaseModel, Field, ValidationError
from safetensors.numpy import load_file, save_file

from calm_core.alpha_head import AlphaHead, HeadKind
from calm_core.atomic import atomic_dir, atomic_write_text
from calm_core.errors import ArtifactError
from calm_core.hashing import folder_index, index_mismatch, sha256_file
from calm_core.prompts import AnswerFormat
from calm_core.semantic import SemanticCalibration

FORMAT_VERSION = 1
HEAD_FILE = "alpha_head.safetensors"
MANIFEST_FILE = "manifest.json"
ADAPTER_DIR = "adapter"
VERSION_NAME = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"  # an artifact version's name: no separators, no `..`
FREE_FORM_DIR = "free_form"  # inside a multiple-choice artifact: the artifact that serves free-form answers


def check_version_name(version: object) -> str:
    """`version` if it can name a version: a version is a folder wherever it is kept (`<registry>/<version>/`, caches,
    a registry URL), so one path component, never `.`, `..` or a path; ValueError otherwise."""
    if not isinstance(version, str) or not re.fullmatch(VERSION_NAME, version):
        raise ValueError(f"{version!r} is not an artifact version name (1-128 letters, digits, '.', '_' or '-', "
                         "starting with a letter or digit)")
    return version


VersionName = Annotated[str, AfterValidator(check_version_name)]


class BaseModelRef(BaseModel):
    id: str
    weights_sha256: str


class TokenizerRef(BaseModel):
    sha256: str
    vocab_size: int = Field(gt=0)


class DataRef(BaseModel):
    name: str
    sha256: str


class ReferenceHistogram(BaseModel):
    """Equal-width histogram of calibrated confidences on held-out data of one domain; drift is measured against it."""

    bin_edges: list[float]
    counts: list[int]

    def model_post_init(self, __context) -> None:
        if len(self.bin_edges) != len(self.counts) + 1:
            raise ValueError("bin_edges must have one more entry than counts")


class Recalibration(BaseModel):
    """The lineage of a recalibrated version: its parent and the labelled map that made it (calm_core/recalibration.py)."""

    parent: str
    domain: str
    temperature: float
    fitted_on: str
    held_out: dict[str, float]


class ArtifactManifest(BaseModel):
    format_version: int = FORMAT_VERSION
    artifact_version: VersionName
    head_kind: HeadKind
    head_sha256: str
    base_model: BaseModelRef
    tokenizer: TokenizerRef
    training_data: list[DataRef] = []
    created_at: str
    method: str = "identity"
    # How the head was fitted to multiple-choice answers: one letter token, or each option's text (cloze).
    answer_format: AnswerFormat = AnswerFormat.LETTER
    # Which answers the weights and head were fitted for: multiple-choice scoring, free-form answers, or both (identity
    # and hand-made heads). A multiple-choice artifact may carry a free-form one in FREE_FORM_DIR (one artifact for every
    # request); without it, free-form answers come from the base model with its own probabilities.
    applies_to: Literal["all", "multiple_choice", "free_form"] = "all"
    metrics: dict[str, dict[str, float]] = {}
    reference_histograms: dict[str, ReferenceHistogram] = {}
    has_adapter: bool = False
    # The free-form artifact inside FREE_FORM_DIR (its version), when this one serves both kinds of answer.
    free_form_version: VersionName | None = None
    # sha256 of the artifact's other files ("adapter/adapter_model.safetensors": …), checked on load like head_sha256;
    # None in manifests written before files were recorded (the registry records them on its copy).
    files: dict[str, str] | None = None
    # Free-form answers' semantic confidence: how samples are drawn and the map from agreement to probability (fitted
    # by `calm artifacts fit-semantic`; absent: the unfitted defaults).
    semantic: SemanticCalibration | None = None
    # Multiple-choice option scores are divided by this before their softmax: 1 unless the version was recalibrated on
    # a domain's labels (`recalibration` says from which parent, on what, and its held-out check).
    option_temperature: float = Field(default=1.0, gt=0)
    # A free-form mode's token confidence c is served as c ** (1 / token_temperature): 1 unless recalibrated on labels.
    token_temperature: float = Field(default=1.0, gt=0)
    recalibration: Recalibration | None = None


def new_version_id(method: str) -> str:
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return f"{method}-{stamp}-{uuid.uuid4().hex[:8]}"


def save_artifact(
    path: str | Path,
    head: AlphaHead,
    *,
    base_model: BaseModelRef,
    tokenizer: TokenizerRef,
    method: str,
    training_data: list[DataRef] | None = None,
    metrics: dict[str, dict[str, float]] | None = None,
    reference_histograms: dict[str, ReferenceHistogram] | None = None,
    adapter_dir: str | Path | None = None,
    artifact_version: str | None = None,
    answer_format: AnswerFormat = AnswerFormat.LETTER,
    applies_to: str = "all",
) -> ArtifactManifest:
    """Write an artifact atomically: readers see the old folder or the complete new one, never a half-written one."""
    head.check_vocab(tokenizer.vocab_size)
    with atomic_dir(path, durable=True) as tmp:
        head_path = tmp / HEAD_FILE
        save_file({"scale": head.scale, "shift": head.shift}, str(head_path))
        if adapter_dir is not None:
            shutil.copytree(adapter_dir, tmp / ADAPTER_DIR)
        manifest = ArtifactManifest(
            artifact_version=artifact_version or new_version_id(method),
            head_kind=head.kind,
            head_sha256=sha256_file(head_path),
            base_model=base_model,
            tokenizer=tokenizer,
            training_data=training_data or [],
            created_at=datetime.now(timezone.utc).isoformat(),
            method=method,
            answer_format=answer_format,
            applies_to=applies_to,
            metrics=metrics or {},
            reference_histograms=reference_histograms or {},
            has_adapter=adapter_dir is not None,
        )
        manifest = _write_manifest(tmp, manifest)
    return manifest


def _own_files(folder: Path) -> dict[str, str]:
    """The hashes a manifest records: its adapter's files (the head has head_sha256, a free-form mode its manifest)."""
    adapter = folder / ADAPTER_DIR
    found = folder_index(adapter) if adapter.is_dir() else {}
    return {f"{ADAPTER_DIR}/{name}": digest for name, digest in found.items()}


def _check_files(path: Path, manifest: ArtifactManifest) -> None:
    if manifest.files is None:  # written before files were recorded: its adapter cannot be checked
        return
    if manifest.has_adapter and not any(name.startswith(f"{ADAPTER_DIR}/") for name in manifest.files):
        raise ArtifactError(f"{path}: the manifest records no hash of the adapter's files")
    bad = index_mismatch(path, manifest.files)
    if bad is not None:
        raise ArtifactError(f"artifact {path}: {bad}, not as its manifest records (corrupt or edited)")


def record_files(path: str | Path) -> None:
    """Record the hashes of an artifact's files (and its free-form mode's) where its manifest was written before they
    were recorded; a manifest that records them is left alone."""
    for folder in (Path(path), Path(path) / FREE_FORM_DIR):
        if (folder / MANIFEST_FILE).is_file() and read_manifest(folder).get("files") is None:
            update_manifest(folder, files=_own_files(folder))


class LoadedArtifact(BaseModel, arbitrary_types_allowed=True):
    path: Path
    manifest: ArtifactManifest
    head: AlphaHead

    @property
    def adapter_dir(self) -> Path | None:
        return self.path / ADAPTER_DIR if self.manifest.has_adapter else None

    @property
    def free_form(self) -> "LoadedArtifact | None":
        """The artifact that serves free-form answers: the one inside, this one if it is fitted to free form (or to
        everything), else None (free-form answers then use the base weights without a head)."""
        if self.manifest.free_form_version is not None:
            return load_artifact(self.path / FREE_FORM_DIR)
        return self if self.manifest.applies_to in ("free_form", "all") else None

    @property
    def adapter_rank(self) -> int:
        """The LoRA rank of the adapter (0 without one)."""
        if self.adapter_dir is None:
            return 0
        return int(json.loads((self.adapter_dir / "adapter_config.json").read_text())["r"])


def load_artifact(
    path: str | Path,
    *,
    expect_vocab_size: int | None = None,
    expect_tokenizer_sha256: str | None = None,
    expect_weights_sha256: str | None = None,
) -> LoadedArtifact:
    """Load and verify an artifact; any mismatch raises ArtifactError with a one-line reason."""
    path = Path(path)
    manifest_path, head_path = path / MANIFEST_FILE, path / HEAD_FILE
    if not manifest_path.is_file():
        raise ArtifactError(f"not an alpha-head artifact: {manifest_path} is missing")
    if not head_path.is_file():
        raise ArtifactError(f"artifact {path} is incomplete: {HEAD_FILE} is missing")
    try:
        manifest = ArtifactManifest.model_validate_json(manifest_path.read_text(encoding="utf-8"))
    except ValidationError as e:
        first = e.errors()[0]
        raise ArtifactError(f"{manifest_path}: invalid manifest ({'.'.join(map(str, first['loc']))}: {first['msg']})") from None
    if manifest.format_version != FORMAT_VERSION:
        raise ArtifactError(f"{path}: artifact format {manifest.format_version} is not supported (expected {FORMAT_VERSION})")
    if sha256_file(head_path) != manifest.head_sha256:
        raise ArtifactError(f"{head_path}: contents do not match the hash in the manifest (corrupt or edited)")
    _check_files(path, manifest)
    try:
        tensors = load_file(str(head_path))
        head = AlphaHead(np.asarray(tensors["scale"]), np.asarray(tensors["shift"]))
    except (KeyError, ValueError) as e:
        raise ArtifactError(f"{head_path}: invalid alpha head ({e})") from None
    if head.kind is not manifest.head_kind:
        raise ArtifactError(f"{path}: manifest says a {manifest.head_kind.value} head, file holds a {head.kind.value} one")
    if head.kind is HeadKind.VECTOR and head.size != manifest.tokenizer.vocab_size:
        raise ArtifactError(f"{path}: head has {head.size} entries, manifest vocabulary has {manifest.tokenizer.vocab_size}")
    if expect_vocab_size is not None and head.kind is HeadKind.VECTOR and head.size != expect_vocab_size:
        raise ArtifactError(
            f"{path}: alpha head covers {head.size} tokens but the model's vocabulary has {expect_vocab_size}"
        )
    if expect_tokenizer_sha256 is not None and manifest.tokenizer.sha256 != expect_tokenizer_sha256:
        raise ArtifactError(f"{path}: artifact was trained with a different tokenizer than the model's")
    if expect_weights_sha256 is not None and manifest.base_model.weights_sha256 != expect_weights_sha256:
        raise ArtifactError(
            f"{path}: artifact was trained on base model {manifest.base_model.id!r} with other weights than the model given"
        )
    loaded = LoadedArtifact(path=path, manifest=manifest, head=head)
    if manifest.free_form_version is not None:
        inner = load_artifact(path / FREE_FORM_DIR, expect_vocab_size=expect_vocab_size,
                              expect_tokenizer_sha256=expect_tokenizer_sha256, expect_weights_sha256=expect_weights_sha256)
        if inner.manifest.artifact_version != manifest.free_form_version or inner.manifest.applies_to != "free_form":
            raise ArtifactError(f"{path}: {FREE_FORM_DIR}/ is not the free-form artifact the manifest names "
                                f"({manifest.free_form_version})")
        if inner.manifest.base_model != manifest.base_model or inner.manifest.tokenizer != manifest.tokenizer:
            raise ArtifactError(f"{path}: the free-form artifact inside was trained on another base model or tokenizer")
    return loaded


def attach_free_form(multiple_choice: str | Path, free_form: str | Path, out: str | Path) -> ArtifactManifest:
    """One artifact for every request: the multiple-choice artifact with the free-form one inside, a new version.
    Reference histograms of domains only the free-form artifact has (trivia, entity knowledge) join the manifest."""
    mc, ff = load_artifact(multiple_choice), load_artifact(free_form)
    if mc.manifest.applies_to != "multiple_choice" or ff.manifest.applies_to != "free_form":
        raise ArtifactError("attach a free-form artifact (applies_to free_form) to a multiple-choice one")
    if mc.manifest.base_model != ff.manifest.base_model or mc.manifest.tokenizer != ff.manifest.tokenizer:
        raise ArtifactError("the two artifacts were trained on different base models or tokenizers")
    histograms = {**{d: h for d, h in ff.manifest.reference_histograms.items() if d != "all"},
                  **mc.manifest.reference_histograms}
    manifest = mc.manifest.model_copy(update={
        "artifact_version": new_version_id(mc.manifest.method), "free_form_version": ff.manifest.artifact_version,
        "reference_histograms": histograms, "created_at": datetime.now(timezone.utc).isoformat()})
    with atomic_dir(out, durable=True) as tmp:
        _copy_parts(mc.path, tmp, (HEAD_FILE, ADAPTER_DIR))
        shutil.copytree(ff.path, tmp / FREE_FORM_DIR, ignore=shutil.ignore_patterns(FREE_FORM_DIR))
        record_files(tmp / FREE_FORM_DIR)
        _write_manifest(tmp, manifest)
    return manifest


def derive_version(parent: str | Path, out: str | Path, method: str, **changes) -> ArtifactManifest:
    """A new version with the parent's head, adapter and free-form mode and some manifest fields changed (a labelled
    recalibration): a new version id, written atomically."""
    src = load_artifact(parent)
    manifest = ArtifactManifest.model_validate({**src.manifest.model_dump(), **changes,
                                                "artifact_version": new_version_id(method),
                                                "created_at": datetime.now(timezone.utc).isoformat()})
    with atomic_dir(out, durable=True) as tmp:
        _copy_parts(src.path, tmp, (HEAD_FILE, ADAPTER_DIR, FREE_FORM_DIR))
        record_files(tmp / FREE_FORM_DIR)
        _write_manifest(tmp, manifest)
    return manifest


def _write_manifest(folder: Path, manifest: ArtifactManifest) -> ArtifactManifest:
    """A manifest with the hashes of the files the folder holds (written there, or copied from a parent and checked
    when it was loaded), as written."""
    manifest = manifest.model_copy(update={"files": _own_files(folder)})
    (folder / MANIFEST_FILE).write_text(manifest.model_dump_json(indent=2), encoding="utf-8")
    return manifest


def _copy_parts(src: Path, dst: Path, names: tuple[str, ...]) -> None:
    """The named files and folders of an artifact that it has (an adapter or free-form mode is optional)."""
    for name in names:
        if (src / name).is_dir():
            shutil.copytree(src / name, dst / name)
        elif (src / name).is_file():
            shutil.copy2(src / name, dst / name)


def read_manifest(path: str | Path) -> dict:
    return json.loads((Path(path) / MANIFEST_FILE).read_text(encoding="utf-8"))


def update_manifest(path: str | Path, **fields) -> ArtifactManifest:
    """Rewrite an artifact's manifest with some fields changed (metrics, reference histograms measured after export);
    the head and adapter are untouched, the file is replaced atomically."""
    path = Path(path)
    manifest = ArtifactManifest.model_validate_json((path / MANIFEST_FILE).read_text(encoding="utf-8"))
    manifest = ArtifactManifest.model_validate({**manifest.model_dump(), **fields})
    atomic_write_text(path / MANIFEST_FILE, manifest.model_dump_json(indent=2))
    return manifest
