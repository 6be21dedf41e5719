"""Shared fixtures. Heavy ones (the real model) are session-scoped and only built by tests marked slow."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# torch with 2 threads on a busy 2-core machine slows by 10-100x (oversubscription); tests stay single-threaded.
os.environ.setdefault("OMP_NUM_THREADS", "1")
REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = REPO.parent / "shared" / "data"
os.environ.setdefault("CALM_HOME", str(REPO / ".calm"))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.fail(f"benchmark data not found at {SHARED_DATA}: tests read ../shared/data beside the checkout")
    return SHARED_DATA


@pytest.fixture(scope="session")
def embedded_model_dir() -> Path:
    from calm_core.models import prepare_embedded

    return prepare_embedded("float32")


@pytest.fixture(scope="session")
def embedded_model(embedded_model_dir):
    import torch

    torch.set_num_threads(1)
    from training.scoring import load_hf_model

    return load_hf_model(str(embedded_model_dir), "float32")


@pytest.fixture(scope="session")
def shipped_artifact():
    """The artifact `calm serve` uses by default on the embedded model."""
    from calm_cli.serving import DEFAULT_ARTIFACTS
    from calm_core.artifact import load_artifact
    from calm_core.models import EMBEDDED_ID

    return load_artifact(DEFAULT_ARTIFACTS[EMBEDDED_ID])


@pytest.fixture(scope="session")
def shipped_model(shipped_artifact, embedded_model_dir):
    """The embedded model with the shipped LoRA adapter applied by peft (not merged: independent of the merged folder
    the gateway serves)."""
    import torch
    from peft import PeftModel

    from training.scoring import load_hf_model

    torch.set_num_threads(1)
    model, tokenizer = load_hf_model(str(embedded_model_dir), "float32")
    if shipped_artifact.adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(shipped_artifact.adapter_dir)).eval()
    return model, tokenizer


@pytest.fixture(scope="session")
def free_form_model(shipped_artifact, embedded_model_dir):
    """The embedded model with the shipped free-form mode's adapter applied by peft, and that mode's head."""
    import torch
    from peft import PeftModel

    from training.scoring import load_hf_model

    torch.set_num_threads(1)
    mode = shipped_artifact.free_form
    model, tokenizer = load_hf_model(str(embedded_model_dir), "float32")
    if mode.adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(mode.adapter_dir)).eval()
    return model, tokenizer, mode.head


@pytest.fixture(scope="module")
def postgres_url():
    from tests.postgres import postgres_server

    with postgres_server() as url:
        yield url


@pytest.fixture(params=["sqlite", "postgresql"])
def database(request, tmp_path):
    """A fresh database of each backend: a SQLite file, or a PostgreSQL database emptied of every table."""
    if request.param == "sqlite":
        yield str(tmp_path / "g.sqlite3")
        return
    url = request.getfixturevalue("postgres_url")
    from sqlalchemy import create_engine, text

    engine = create_engine(url)
    with engine.begin() as c:
        c.execute(text("DROP SCHEMA public CASCADE"))
        c.execute(text("CREATE SCHEMA public"))
    engine.dispose()
    yield url
