"""The registry at a URL, against a real S3 API (moto's server on this machine): versions registered on one machine are
fetched and checked on another, engines resolve versions named by requests from it, the serving list lives there,
and a version changed on the store is refused."""

from __future__ import annotations

import filecmp

import pytest

from calm_core.paths import BUNDLED_DIR

SHIPPED = BUNDLED_DIR / "artifacts" / "smollm2-135m-instruct"
BUCKET = "calm-registry"


@pytest.fixture(scope="module")
def s3(s3_store):
    return s3_store[0]


def test_a_version_registered_on_one_machine_is_fetched_and_checked_on_another(s3, tmp_path):
    from calm_core.artifact import load_artifact
    from calm_core.db import Database
    from calm_core.registry import Registry

    db = Database(tmp_path / "shared.sqlite3")  # PostgreSQL on a fleet: the rows are shared, the folders are not
    url = f"s3://{BUCKET}/prod"
    worker = Registry(db, tmp_path / "worker-registry", url)
    version = worker.ensure_default(SHIPPED)
    assert s3.exists(f"{BUCKET}/prod/{version}/calm-index.json")
    assert s3.exists(f"{BUCKET}/prod/{version}/adapter/adapter_model.safetensors")

    gateway = Registry(db, tmp_path / "gateway-registry", url)
    fetched = gateway.path_of(version)
    assert fetched == tmp_path / "gateway-registry" / version
    assert load_artifact(fetched).manifest.artifact_version == version
    for name in ("alpha_head.safetensors", "adapter/adapter_model.safetensors", "free_form/manifest.json"):
        assert filecmp.cmp(SHIPPED / name, fetched / name, shallow=False)
    assert gateway.path_of(version) == fetched  # fetched once

    gateway.publish_served([version])
    assert f'"versions": ["{version}"]' in s3.cat_file(f"{BUCKET}/prod/serving.json").decode()


def test_an_engine_resolves_versions_from_the_url_and_refuses_what_does_not_match(s3, tmp_path, monkeypatch):
    from adapters.vllm_plugins.common import resolve_version, served_adapter
    from adapters.vllm_plugins.warm import served_list, served_names
    from calm_core.db import Database
    from calm_core.registry import Registry

    url = f"s3://{BUCKET}/engines"
    registry = Registry(Database(tmp_path / "db.sqlite3"), tmp_path / "gateway", url)
    version = registry.ensure_default(SHIPPED)
    registry.publish_served([version])
    monkeypatch.setenv("CALM_REGISTRY_URL", url)
    monkeypatch.setenv("CALM_REGISTRY_DIR", str(tmp_path / "engine"))

    assert resolve_version(version) == tmp_path / "engine" / version
    assert resolve_version(f"{version}:free_form") == tmp_path / "engine" / version / "free_form"
    assert served_adapter(version) == tmp_path / "engine" / version / "adapter"
    assert served_list(tmp_path / "engine") == [version]
    assert served_names(tmp_path / "engine", [version]) == [version, f"{version}:free_form"]
    with pytest.raises(ValueError, match="no artifact version 'calm-none'"):
        resolve_version("calm-none")
    with pytest.raises(ValueError, match="not a path"):
        resolve_version("../gateway")

    # A file of the version changed on the store: another engine refuses it, and keeps nothing of it.
    s3.pipe_file(f"{BUCKET}/engines/{version}/alpha_head.safetensors", b"not the head")
    monkeypatch.setenv("CALM_REGISTRY_DIR", str(tmp_path / "engine-2"))
    with pytest.raises(ValueError, match="do not match the version's index"):
        resolve_version(version)
    assert not (tmp_path / "engine-2" / version).exists()
    assert resolve_version(version, {"calm_registry": str(tmp_path / "engine")}) == tmp_path / "engine" / version
