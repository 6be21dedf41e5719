"""Durable means durable (issue 63, item 6): SQLite commits reach the disk, registry writes are fsynced, every file of a
version and of a cached copy of weights is checked against a recorded hash, a version name is one safe path component,
and training's caches and checkpoints are read as data (torch.load weights_only)."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from calm_core.paths import BUNDLED_DIR
from tests.test_cli import assert_one_line_error, run_calm

SHIPPED = BUNDLED_DIR / "artifacts" / "smollm2-135m-instruct"
ADAPTER = "adapter/adapter_model.safetensors"


def legacy_copy(dst: Path) -> Path:
    """The shipped artifact as an artifact written before its adapter's hashes were recorded."""
    shutil.copytree(SHIPPED, dst)
    for manifest in dst.rglob("manifest.json"):
        fields = json.loads(manifest.read_text())
        fields.pop("files", None)
        manifest.write_text(json.dumps(fields))
    return dst


# -- SQLite ------------------------------------------------------------------------------------------------------
def test_sqlite_commits_fsync_the_wal(tmp_path):
    from calm_core.db import Database

    db = Database(tmp_path / "calm.sqlite3")
    with db.engine.connect() as conn:
        assert conn.exec_driver_sql("PRAGMA journal_mode").scalar() == "wal"
        assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 2  # FULL; NORMAL (1) may lose the last commits
    with db._write(wait=False) as conn:  # the event loop's own connection too
        assert conn.exec_driver_sql("PRAGMA synchronous").scalar() == 2
    db.close()


# -- registry writes fsynced -------------------------------------------------------------------------------------
def test_a_registered_version_and_the_serving_list_are_fsynced(tmp_path, monkeypatch):
    """Every file and folder of the version's copy, and the registry folder after the rename that lists it; the
    serving list and its folder. Recorded by inode: a file is fsynced under its temporary name, then renamed."""
    from calm_core.db import Database
    from calm_core.registry import SERVED_FILE, Registry

    synced: set[int] = set()
    real_fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.add(os.fstat(fd).st_ino), real_fsync(fd))[1])
    root = tmp_path / "registry"
    registry = Registry(Database(tmp_path / "calm.sqlite3"), root)
    version = registry.add(SHIPPED, trigger="import").version
    folder = root / version
    for path in [folder, *folder.rglob("*")]:
        assert path.stat().st_ino in synced, path
    assert root.stat().st_ino in synced
    assert tmp_path.stat().st_ino in synced  # the registry folder was new: its own entry too (found in review)

    synced.clear()
    registry.publish_served([version])
    assert (root / SERVED_FILE).stat().st_ino in synced and root.stat().st_ino in synced


# -- every file checked ------------------------------------------------------------------------------------------
def test_an_artifact_whose_adapter_changed_is_refused(tmp_path):
    from calm_core.artifact import derive_version, load_artifact
    from calm_core.errors import ArtifactError

    derive_version(SHIPPED, tmp_path / "v", "recalibrated", option_temperature=1.2)
    assert load_artifact(tmp_path / "v").adapter_dir is not None
    with open(tmp_path / "v" / ADAPTER, "ab") as f:
        f.write(b"\0")  # a byte more: what a torn write or a disk fault leaves
    with pytest.raises(ArtifactError, match=f"{ADAPTER} \\(contents differ\\), not as its manifest records"):
        load_artifact(tmp_path / "v")
    (tmp_path / "v" / ADAPTER).unlink()
    with pytest.raises(ArtifactError, match=f"{ADAPTER} \\(missing\\)"):
        load_artifact(tmp_path / "v")
    derive_version(SHIPPED, tmp_path / "w", "recalibrated")
    with open(tmp_path / "w" / "free_form" / ADAPTER, "ab") as f:  # the free-form mode's, inside
        f.write(b"\0")
    with pytest.raises(ArtifactError, match=f"free_form: {ADAPTER} \\(contents differ\\)"):
        load_artifact(tmp_path / "w")


def test_the_registry_records_hashes_of_an_older_artifact_and_checks_its_copy(tmp_path):
    """An artifact written before the adapter's hashes were recorded gets them on the registry's copy (and its
    free-form mode's); a copy that no longer matches is refused when loaded."""
    from calm_core.artifact import load_artifact
    from calm_core.db import Database
    from calm_core.errors import ArtifactError
    from calm_core.registry import Registry

    registry = Registry(Database(tmp_path / "calm.sqlite3"), tmp_path / "registry")
    version = registry.add(legacy_copy(tmp_path / "old"), trigger="import").version
    copy = registry.path_of(version)
    assert ADAPTER in load_artifact(copy).manifest.files and ADAPTER in load_artifact(copy / "free_form").manifest.files
    (copy / ADAPTER).write_bytes((copy / ADAPTER).read_bytes()[:-1])
    with pytest.raises(ArtifactError, match="contents differ"):
        load_artifact(copy)


def test_a_copy_left_by_an_earlier_registration_is_reused_only_if_it_checks_out(tmp_path):
    from calm_core.artifact import load_artifact
    from calm_core.db import Database
    from calm_core.registry import Registry

    version = load_artifact(SHIPPED).manifest.artifact_version
    leftover = tmp_path / "registry" / version  # copied in, its row never written, its adapter since damaged
    shutil.copytree(SHIPPED, leftover)
    (leftover / ADAPTER).write_bytes(b"damaged")
    registry = Registry(Database(tmp_path / "calm.sqlite3"), tmp_path / "registry")
    registry.add(SHIPPED, trigger="import")
    assert (leftover / ADAPTER).read_bytes() == (SHIPPED / ADAPTER).read_bytes()


def test_a_file_is_hashed_once_per_process_however_often_it_is_loaded(tmp_path, monkeypatch):
    from calm_core import hashing
    from calm_core.artifact import load_artifact

    shutil.copytree(SHIPPED, tmp_path / "v")
    hashed = []
    real = hashing.sha256_file
    monkeypatch.setattr(hashing, "sha256_file", lambda p: (hashed.append(Path(p).name), real(p))[1])
    for _ in range(3):
        load_artifact(tmp_path / "v").free_form
    assert hashed.count("adapter_model.safetensors") == 2  # the version's adapter and its free-form mode's, once each


def fake_merge(monkeypatch, weights: bytes = b"weights"):
    """peft and transformers as far as merged_model_dir uses them: a merge that writes a config and one weight file."""
    class Model:
        def merge_and_unload(self):
            return self

        def save_pretrained(self, out, safe_serialization=True):
            (Path(out) / "config.json").write_text("{}")
            (Path(out) / "model.safetensors").write_bytes(weights)

    load = types.SimpleNamespace(from_pretrained=lambda *a, **k: Model())
    monkeypatch.setitem(sys.modules, "peft", types.SimpleNamespace(PeftModel=load))
    monkeypatch.setitem(sys.modules, "transformers", types.SimpleNamespace(AutoModelForCausalLM=load))


def test_a_cached_merged_copy_that_changed_is_built_again_not_served(tmp_path, monkeypatch, shipped_artifact):
    from adapters.hosting.merged_weights import built_merged_dir, merged_model_dir

    base = tmp_path / "base"
    base.mkdir()
    (base / "tokenizer.json").write_text("{}")
    fake_merge(monkeypatch)
    built = merged_model_dir(str(base), shipped_artifact, tmp_path)
    assert built_merged_dir(str(base), shipped_artifact, tmp_path) == built
    (built / "model.safetensors").write_bytes(b"weights, cut")
    assert built_merged_dir(str(base), shipped_artifact, tmp_path) is None
    assert merged_model_dir(str(base), shipped_artifact, tmp_path) == built
    assert (built / "model.safetensors").read_bytes() == b"weights"
    (built / "calm-cache.json").unlink()  # a copy whose hashes were never recorded is not trusted either
    assert built_merged_dir(str(base), shipped_artifact, tmp_path) is None


# -- version names -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["..", ".", "", "/var/lib/calm", "a/b", "../x", "-v", ".hidden", "v\n", "v" * 129])
def test_a_version_name_is_one_safe_path_component(name):
    from pydantic import ValidationError

    from calm_core.artifact import ArtifactManifest

    fields = json.loads((SHIPPED / "manifest.json").read_text())
    with pytest.raises(ValidationError, match="not an artifact version name"):
        ArtifactManifest.model_validate({**fields, "artifact_version": name})
    with pytest.raises(ValidationError, match="not an artifact version name"):
        ArtifactManifest.model_validate({**fields, "free_form_version": name})


def test_every_version_name_the_product_makes_is_accepted():
    from calm_core.artifact import check_version_name, new_version_id

    for name in (new_version_id("calm_scalar"), new_version_id("recalibrated"), "calm_scalar-20261130T212846Z-29a9fde6",
                 "test-v1", "v1", "shipped", "recalibrated-other-weights", "a..b", "v" * 128):
        assert check_version_name(name) == name


def test_calm_artifacts_add_refuses_a_version_that_is_a_path(tmp_path):
    victim = tmp_path / "var-lib-calm"
    victim.mkdir()
    (victim / "keep").write_text("the operator's data")
    shutil.copytree(SHIPPED, tmp_path / "bad")
    fields = json.loads((tmp_path / "bad" / "manifest.json").read_text())
    (tmp_path / "bad" / "manifest.json").write_text(json.dumps({**fields, "artifact_version": str(victim)}))
    env = {"CALM_DB_PATH": str(tmp_path / "g.db"), "CALM_REGISTRY_DIR": str(tmp_path / "registry")}
    assert_one_line_error(run_calm("artifacts", "add", str(tmp_path / "bad"), env=env),
                          f"{str(victim)!r} is not an artifact version name")
    assert (victim / "keep").read_text() == "the operator's data"


def test_a_registry_url_refuses_a_version_that_is_a_path(tmp_path):
    from calm_core.registry_mirror import MirrorError, RegistryMirror

    (tmp_path / "store" / "x").mkdir(parents=True)
    mirror = RegistryMirror(f"file://{tmp_path / 'store' / 'prod'}")
    for name in ("../x", "/etc", ".."):
        with pytest.raises(MirrorError, match="not an artifact version name"):
            mirror.download(name, tmp_path / "local")
        with pytest.raises(MirrorError, match="not an artifact version name"):
            mirror.upload(name, SHIPPED)
    assert list((tmp_path / "store" / "x").iterdir()) == []


# -- training reads data, never code -----------------------------------------------------------------------------
RAN = []


def _ran(*args):
    RAN.append(args)
    return {}


class Payload:
    """What a hostile cache or checkpoint file holds: unpickling it calls a function."""

    def __reduce__(self):
        return (_ran, ("code from a file",))


def test_an_encoded_set_cache_is_read_as_data(tmp_path):
    import torch

    from calm_core.splits import ROLES
    from training.features import _key, encode_sets

    fmt = SimpleNamespace(name="letter", fingerprint=lambda tok, q: "")
    split = SimpleNamespace(sources={role: {} for role in ROLES})
    split.sources["train"]["one"] = [object()]  # never encoded: its cache file is all there is
    torch.save([Payload()], tmp_path / f"prefix-letter-{_key('w', 0, 'letter', [''])}.pt")
    RAN.clear()
    with pytest.raises(pickle.UnpicklingError):
        encode_sets(None, None, split, 0, "w", tmp_path, fmt)
    assert RAN == []


def minimal_trainer(out: Path):
    """A Trainer with just what save_checkpoint and resume touch."""
    import torch

    from training.alpha_params import AlphaParams
    from training.config import TrainConfig
    from training.trainer import Trainer

    t = object.__new__(Trainer)
    t.accelerator, t.out, t.step = SimpleNamespace(is_main_process=True), out, 3
    t.cfg = TrainConfig(out_dir=str(out), steps=10)
    t.theta = [torch.nn.Parameter(torch.ones(4))]
    t.alpha = AlphaParams(8)
    t.optimizer = torch.optim.Adam([*t.theta, *t.alpha.parameters()])
    t.train_stream = t.calib_stream = SimpleNamespace(state=lambda: {"epoch": 1, "pos": 8}, load=lambda s: None)
    t.history = [{"g": np.float64(0.5), "step": 1}]
    return t


def test_a_checkpoint_is_written_and_read_as_data(tmp_path):
    import torch

    from calm_core.errors import ConfigError
    from training.trainer import CHECKPOINT

    np.random.seed(7)
    minimal_trainer(tmp_path).save_checkpoint()
    torch.load(tmp_path / CHECKPOINT, weights_only=True)  # numpy arrays or scalars in it would make this fail
    expected = np.random.rand(3)
    np.random.seed(99)
    resumed = minimal_trainer(tmp_path)
    assert resumed.resume() and resumed.history == [{"g": 0.5, "step": 1}]
    np.testing.assert_array_equal(np.random.rand(3), expected)

    torch.save({"config": Payload()}, tmp_path / CHECKPOINT)
    RAN.clear()
    with pytest.raises(ConfigError, match="holds more than tensors and plain values"):
        minimal_trainer(tmp_path).resume()
    assert RAN == []
