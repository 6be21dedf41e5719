"""Engine settings by device: what runs on CPU today stays, CUDA gets vLLM's defaults, every value can be overridden.
The CUDA branch is resolved here without a GPU (the device is passed in, as detection would return it)."""

from __future__ import annotations

import json
import re

import pytest

from adapters.hosting.cpu_limits import omp_threads_set, usable_cpus
from adapters.hosting.engine_settings import (
    EngineCountDecides, EngineOverrides, engine_wait_policy, resolve, wait_policy_before_counting,
)


def test_cpu_defaults_are_todays_engine():
    s = resolve(EngineOverrides(), detected="cpu")
    assert (s.device, s.dtype, s.enforce_eager, s.kv_cache_bytes, s.gpu_memory_utilization) == (
        "cpu", "float32", True, 512 * 1024**2, None)
    assert s.adapter_mode == "merged" and s.enable_prefix_caching is None and s.executor == "uni"
    assert s.engine_start == "forkserver"  # engine cores forked from one server that imported vLLM
    # each prompt prefilled in one step: a seeded request prefilled in chunks kills a CPU engine (CPU_CHUNKED_PREFILL)
    assert s.enable_chunked_prefill is False
    # 32-token blocks: answers read token by token re-use the prefix cache (FLEET_CPU_BLOCK_SIZE)
    assert s.vllm_kwargs() == {"dtype": "float32", "enforce_eager": True, "distributed_executor_backend": "uni",
                               "enable_chunked_prefill": False, "kv_cache_memory_bytes": 512 * 1024**2,
                               "block_size": 32}
    assert s.server_args() == ["--dtype", "float32", "--enforce-eager", "--distributed-executor-backend", "uni",
                               "--no-enable-chunked-prefill", "--block-size", "32", "--kv-cache-memory-bytes",
                               str(512 * 1024**2)]
    # without it vLLM's CPU platform turns "uni" back into a worker process
    assert s.env() == {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def test_cuda_defaults_are_vllms():
    s = resolve(EngineOverrides(), detected="cuda")
    assert (s.device, s.dtype, s.enforce_eager, s.kv_cache_bytes, s.gpu_memory_utilization) == (
        "cuda", "bfloat16", False, None, 0.9)
    assert s.adapter_mode == "lora" and s.enable_prefix_caching is True and s.enable_chunked_prefill is None
    assert s.engine_start == "spawn"  # vLLM's own (it forces spawn once CUDA is initialised)
    assert s.vllm_kwargs() == {"dtype": "bfloat16", "enforce_eager": False, "enable_prefix_caching": True,
                               "gpu_memory_utilization": 0.9}
    assert "--enforce-eager" not in s.server_args() and "--gpu-memory-utilization" in s.server_args()
    assert s.executor is None and s.env() == {} and "--distributed-executor-backend" not in s.server_args()


def test_explicit_values_win_over_the_device():
    s = resolve(EngineOverrides(dtype="float32", enforce_eager=True, adapter_mode="merged", kv_cache_mb=2048),
                detected="cuda")
    assert (s.dtype, s.enforce_eager, s.adapter_mode, s.kv_cache_bytes, s.gpu_memory_utilization) == (
        "float32", True, "merged", 2048 * 1024**2, None)  # a fixed KV size replaces the GPU share
    assert resolve(EngineOverrides(device="cpu"), detected="cuda").device == "cpu"
    assert resolve(EngineOverrides(device="cuda"), detected="cpu").dtype == "bfloat16"
    assert resolve(EngineOverrides(gpu_memory_utilization=0.5), detected="cuda").gpu_memory_utilization == 0.5
    mp = resolve(EngineOverrides(executor="mp"), detected="cpu")
    assert mp.vllm_kwargs()["distributed_executor_backend"] == "mp" and mp.env() == {}
    blocks = resolve(EngineOverrides(block_size=64), detected="cpu")  # unset: 32 on CPU, vLLM's own (16) on CUDA
    assert blocks.vllm_kwargs()["block_size"] == 64
    assert "--block-size 64" in " ".join(blocks.server_args())
    assert resolve(EngineOverrides(), detected="cpu").block_size == 32
    assert resolve(EngineOverrides(), detected="cuda").block_size is None


@pytest.mark.parametrize("overrides, detected, needle", [
    (EngineOverrides(gpu_memory_utilization=0.5), "cpu", "applies to CUDA"),
    (EngineOverrides(gpu_memory_utilization=0.5, kv_cache_mb=256), "cuda", "not both"),
    (EngineOverrides(gpu_memory_utilization=1.5), "cuda", "(0, 1]"),
])
def test_contradictions_are_refused(overrides, detected, needle):
    with pytest.raises(ValueError, match=re.escape(needle)):
        resolve(overrides, detected=detected)


def test_gateway_settings_carry_the_overrides(monkeypatch):
    from gateway.settings import GatewaySettings

    monkeypatch.delenv("CALM_KV_CACHE_MB", raising=False)  # the tests' own setting (conftest.py)
    monkeypatch.setenv("CALM_DEVICE", "cuda")
    monkeypatch.setenv("CALM_GPU_MEMORY_UTILIZATION", "0.6")
    monkeypatch.setenv("CALM_ADAPTER_MODE", "merged")
    monkeypatch.setenv("CALM_ENGINE_START", "forkserver")
    s = resolve(GatewaySettings().engine_overrides())
    assert (s.device, s.gpu_memory_utilization, s.adapter_mode, s.dtype) == ("cuda", 0.6, "merged", "bfloat16")
    assert s.engine_start == "forkserver"
    monkeypatch.delenv("CALM_DEVICE")
    monkeypatch.delenv("CALM_GPU_MEMORY_UTILIZATION")
    assert resolve(GatewaySettings().engine_overrides(), detected="cpu").dtype == "float32"


@pytest.mark.parametrize("value", ['["http://e1:8000", "http://e2:8000"]', "http://e1:8000,http://e2:8000",
                                   " http://e1:8000 , http://e2:8000 ,"])
def test_list_settings_take_a_json_list_or_comma_separated_values(monkeypatch, value):
    """`CALM_UPSTREAM_URLS=http://vllm:8000` is how most people write one URL; pydantic-settings alone took only JSON
    and refused anything else with a traceback."""
    from gateway.settings import GatewaySettings

    monkeypatch.setenv("CALM_UPSTREAM_URLS", value)
    monkeypatch.setenv("CALM_DOMAINS", "legal")
    settings = GatewaySettings()
    assert settings.upstream_urls == ["http://e1:8000", "http://e2:8000"] and settings.domains == ["legal"]
    monkeypatch.setenv("CALM_UPSTREAM_ENGINE_URLS", "[http://e1:8000")
    with pytest.raises(ValueError, match="neither a JSON list nor comma-separated"):
        GatewaySettings()


def test_a_plain_postgresql_url_runs_on_the_installed_driver():
    from calm_core.db import database_url

    for url in ("postgresql://u:pw@db:5432/calm", "postgres://u:pw@db:5432/calm", "postgresql+psycopg://u:pw@db:5432/calm"):
        assert database_url(url) == "postgresql+psycopg://u:pw@db:5432/calm"
    assert database_url("sqlite:///x.db") == "sqlite:///x.db"


def test_engine_teams_that_outnumber_the_cores_wait_passively():
    """Fixed teams (an operator's count): three of 2 on 2 cores spin at each other's barriers, so passive; teams that
    fit the cores (1 each, 5 each of 16) and teams of one have nothing to spin for; an operator's OMP_WAIT_POLICY or
    GOMP_SPINCOUNT stands."""
    assert engine_wait_policy(2, engines=3, cpus=2, environ={}) == "PASSIVE"
    assert engine_wait_policy(4, engines=1, cpus=2, environ={}) == "PASSIVE"  # one team wider than the machine
    assert engine_wait_policy(1, engines=3, cpus=2, environ={}) is None  # the tests' OMP_NUM_THREADS=1
    assert engine_wait_policy(5, engines=3, cpus=16, environ={}) is None
    assert engine_wait_policy(2, engines=1, cpus=2, environ={}) is None  # `calm eval`: one engine, the machine
    assert engine_wait_policy(2, engines=3, cpus=2, environ={"OMP_WAIT_POLICY": "ACTIVE"}) is None
    assert engine_wait_policy(2, engines=3, cpus=2, environ={"GOMP_SPINCOUNT": "300000"}) is None


def test_teams_sharing_the_cores_step_by_step_wait_passively_unless_there_is_one_core():
    """A lone engine's shared team takes every core, beside the gateway's own process: passive wherever a team can be
    wider than one thread."""
    assert engine_wait_policy(None, engines=3, cpus=2, environ={}) == "PASSIVE"
    assert engine_wait_policy(None, engines=1, cpus=16, environ={}) == "PASSIVE"
    assert engine_wait_policy(None, engines=3, cpus=1, environ={}) is None
    assert engine_wait_policy(None, engines=3, cpus=2, environ={"OMP_WAIT_POLICY": "ACTIVE"}) is None


def test_the_wait_policy_is_known_before_the_engines_are_counted_unless_fixed_teams_of_two_or_more_fit_the_cores():
    """What a gateway forking its engine server before it starts engines (engine_server_fork.py) loads torch with: the
    policy `engine_wait_policy` gives for any count of engines, none where vLLM's "mp" executor sizes the teams."""
    assert wait_policy_before_counting(None, "uni", cpus=2, environ={}) == "PASSIVE"  # the default: shared teams
    assert wait_policy_before_counting(None, "uni", cpus=1, environ={}) is None
    assert wait_policy_before_counting(None, "mp", cpus=2, environ={}) is None
    assert wait_policy_before_counting(1, "uni", cpus=2, environ={}) is None  # the tests' OMP_NUM_THREADS=1
    assert wait_policy_before_counting(4, "uni", cpus=2, environ={}) == "PASSIVE"  # wider than the machine alone
    assert wait_policy_before_counting(2, "uni", cpus=2, environ={"OMP_WAIT_POLICY": "ACTIVE"}) is None
    with pytest.raises(EngineCountDecides):
        wait_policy_before_counting(2, "uni", cpus=2, environ={})  # one engine: none; three: PASSIVE


def test_a_gateway_forks_its_engine_server_only_where_its_cpu_engines_fork_and_torch_is_not_loaded(monkeypatch):
    import sys

    from adapters.hosting.engine_server_fork import EngineServerFork

    monkeypatch.delitem(sys.modules, "torch", raising=False)  # as in `calm serve` before its start-up thread
    cpus = usable_cpus()
    plan = EngineServerFork.planned(EngineOverrides(), environ={})
    assert plan is not None and plan.wait_policy == ("PASSIVE" if cpus > 1 else None)
    assert EngineServerFork.planned(EngineOverrides(threads=1), environ={}).wait_policy is None
    assert EngineServerFork.planned(EngineOverrides(device="cuda"), environ={}) is None
    assert EngineServerFork.planned(EngineOverrides(engine_start="spawn"), environ={}) is None
    # Fixed teams of 2 that fit the cores: 1 engine none, more PASSIVE; the spawned server reads the count's
    assert (EngineServerFork.planned(EngineOverrides(threads=2), environ={}) is None) == (cpus >= 2)
    monkeypatch.setitem(sys.modules, "torch", object())  # its OpenMP runtime has read the environment already
    assert EngineServerFork.planned(EngineOverrides(), environ={}) is None


def test_a_later_version_keeps_shared_teams_after_the_first_set_omp_num_threads_for_its_engines(monkeypatch):
    """The gateway's settings read OMP_NUM_THREADS once, as the operator set it: the first version's engines set it for
    their own start (InProcessVLLMEngine._share_cores), and every later version (hot swap, a domain's version) read
    it as a fixed team of that size (found in review, 2026-12-07)."""
    from gateway.settings import GatewaySettings

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("CALM_ENGINE_THREADS", raising=False)
    settings = GatewaySettings()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # as the first version's _share_cores leaves it
    assert settings.engine_overrides().threads is None
    assert GatewaySettings().engine_overrides().threads == 1  # the operator's, where it was set before the start


def test_the_thread_count_comes_from_calm_engine_threads_else_omp_num_threads(monkeypatch):
    from gateway.settings import GatewaySettings

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("CALM_ENGINE_THREADS", raising=False)
    assert omp_threads_set() is None and resolve(GatewaySettings().engine_overrides(), detected="cpu").threads is None
    monkeypatch.setenv("OMP_NUM_THREADS", "not a number")
    assert omp_threads_set() is None
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # an operator's (or the tests') choice is kept for every engine
    assert resolve(GatewaySettings().engine_overrides(), detected="cpu").threads == 1
    monkeypatch.setenv("CALM_ENGINE_THREADS", "3")
    assert resolve(GatewaySettings().engine_overrides(), detected="cpu").threads == 3
    monkeypatch.setenv("CALM_ENGINE_THREADS", "0")
    with pytest.raises(ValueError):
        GatewaySettings()


def test_offline_engines_take_the_gateways_settings_on_cpu(monkeypatch):
    """`calm eval`, reports and the worker's judging run the gateway's engine settings (here a CUDA gateway's), on
    CPU with merged adapters: the GPU share is dropped, the KV cache and the engine start carried."""
    from adapters.clients.inprocess import offline_settings
    from gateway.settings import GatewaySettings

    monkeypatch.setenv("CALM_DEVICE", "cuda")
    monkeypatch.setenv("CALM_ADAPTER_MODE", "lora")
    monkeypatch.setenv("CALM_ENGINE_START", "spawn")
    monkeypatch.setenv("CALM_KV_CACHE_MB", "96")
    s = offline_settings(GatewaySettings().engine_overrides())
    assert (s.device, s.adapter_mode, s.engine_start, s.kv_cache_bytes) == ("cpu", "merged", "spawn", 96 * 1024**2)
    monkeypatch.delenv("CALM_KV_CACHE_MB")
    monkeypatch.setenv("CALM_GPU_MEMORY_UTILIZATION", "0.6")
    s = offline_settings(GatewaySettings().engine_overrides())
    assert (s.gpu_memory_utilization, s.kv_cache_bytes, s.dtype) == (None, 512 * 1024**2, "float32")


def test_offline_scoring_reuses_a_merged_copy_a_gateway_built(monkeypatch, tmp_path, shipped_artifact):
    """A version with an adapter: its merged copy from the cache once a gateway built it, else None (offline scoring
    then merges into a temporary folder); a version without one: the base model."""
    from adapters.hosting.merged_weights import built_merged_dir, served_weights_key, write_cache_index
    from calm_core.artifact import load_artifact
    from training.artifacts import write_identity_artifact

    write_identity_artifact(tmp_path / "identity", with_reference=False)
    monkeypatch.setenv("CALM_HOME", str(tmp_path))
    assert shipped_artifact.adapter_dir is not None and built_merged_dir("/base", shipped_artifact) is None
    built = tmp_path / "merged" / served_weights_key(shipped_artifact)
    built.mkdir(parents=True)
    assert built_merged_dir("/base", shipped_artifact) is None  # a folder without config.json is a merge cut short
    (built / "config.json").write_text("{}")
    assert built_merged_dir("/base", shipped_artifact) is None  # nor one whose files' hashes were never recorded
    write_cache_index(built)
    assert built_merged_dir("/base", shipped_artifact) == built
    identity = load_artifact(tmp_path / "identity")
    assert identity.adapter_dir is None and str(built_merged_dir("/base", identity)) == "/base"


def test_versions_with_the_same_adapter_are_served_from_one_copy_of_the_weights(tmp_path, shipped_artifact):
    """A recalibrated version and a retrained free-form mode beside its parent's multiple-choice mode keep the parent's
    adapter: one merged copy (so one engine) serves them all; another adapter, or the same one on other base weights,
    gets its own; a manifest that records no file hashes keeps a copy of its own version."""
    from adapters.hosting.merged_weights import served_weights_key
    from calm_core.artifact import derive_version, load_artifact

    derive_version(shipped_artifact.path, tmp_path / "recalibrated", "recalibrated", option_temperature=1.5)
    recalibrated = load_artifact(tmp_path / "recalibrated")
    assert recalibrated.manifest.artifact_version != shipped_artifact.manifest.artifact_version
    assert served_weights_key(recalibrated) == served_weights_key(shipped_artifact)
    m = shipped_artifact.manifest
    other_files = {**m.files, "adapter/adapter_model.safetensors": "0" * 64}
    for changed in (m.model_copy(update={"files": other_files}),
                    m.model_copy(update={"base_model": m.base_model.model_copy(update={"weights_sha256": "f" * 64})})):
        moved = shipped_artifact.model_copy(update={"manifest": changed})
        assert served_weights_key(moved) != served_weights_key(shipped_artifact)
    unrecorded = shipped_artifact.model_copy(update={"manifest": m.model_copy(update={"files": None})})
    assert served_weights_key(unrecorded) == m.artifact_version


def test_a_served_copy_of_the_weights_gets_the_tokenizer_files_transformers_would_save(tmp_path, embedded_model_dir):
    """Merged and folded copies get the base model's tokenizer by copying its files (a load holds the GIL for most of
    a second, which stalled a serving gateway during a promotion): the same files, byte for byte, as loading the
    tokenizer and saving it again, and the copy loads to the same vocabulary and chat template."""
    from transformers import AutoTokenizer

    from adapters.hosting.merged_weights import copy_tokenizer

    copied, saved = tmp_path / "copied", tmp_path / "saved"
    copied.mkdir()
    copy_tokenizer(embedded_model_dir, copied)
    original = AutoTokenizer.from_pretrained(embedded_model_dir)
    original.save_pretrained(saved)
    names = sorted(p.name for p in saved.iterdir())
    assert sorted(p.name for p in copied.iterdir()) == names and "tokenizer.json" in names
    assert all((copied / n).read_bytes() == (saved / n).read_bytes() for n in names if n != "tokenizer_config.json")
    # transformers writes how a load was made into tokenizer_config.json (`local_files_only`: true under
    # HF_HUB_OFFLINE, so a model prepared by `make serve` and re-saved under `make test` differ in that flag alone)
    configs = [json.loads((folder / "tokenizer_config.json").read_text()) for folder in (copied, saved)]
    for config in configs:
        config.pop("local_files_only", None)
    assert configs[0] == configs[1]
    again = AutoTokenizer.from_pretrained(copied)
    assert again.get_vocab() == original.get_vocab() and again.chat_template == original.chat_template


def test_a_gateway_loads_the_tokenizer_and_vocabulary_size_autotokenizer_and_autoconfig_give(tmp_path,
                                                                                               embedded_model_dir):
    """A gateway (calm_cli/serving.py, through calm_core/models.py) loads a tokenizer that is tokenizer.json alone by
    its own class (AutoTokenizer's import brings torch, which an upstream gateway needs for nothing else:
    tests/test_upstream.py checks it stays out) and reads the vocabulary size from config.json: the same class,
    vocabulary, template and token ids as AutoTokenizer, the same size as AutoConfig; a tokenizer of another class,
    and a config without the field, go through them."""
    import shutil

    from transformers import AutoConfig, AutoTokenizer

    from transformers.models.auto.tokenization_auto import (
        MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS, TOKENIZER_MAPPING_NAMES,
    )

    from calm_core.models import (
        PLAIN_TOKENIZER_CLASSES, PLAIN_TOKENIZER_MODEL_TYPES, model_tokenizer, model_vocab_size, plain_tokenizer_class,
    )

    # The model types taken by their own class are ones AutoTokenizer leaves to the hub's generic class (this
    # transformers: none it replaces, none registered to a class of its own).
    for model_type in PLAIN_TOKENIZER_MODEL_TYPES:
        assert model_type not in MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS
        assert TOKENIZER_MAPPING_NAMES.get(model_type) in (None, *PLAIN_TOKENIZER_CLASSES), model_type

    other = tmp_path / "other"
    shutil.copytree(embedded_model_dir, other, ignore=shutil.ignore_patterns("*.safetensors", "*.gguf"))
    config = json.loads((other / "tokenizer_config.json").read_text())
    (other / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "GPT2Tokenizer"}))
    text = [{"role": "user", "content": "Which gas do plants absorb? Ünïcode, digits 12345 and  spaces."}]
    for folder in (embedded_model_dir, other):
        ours, theirs = model_tokenizer(folder), AutoTokenizer.from_pretrained(folder)
        assert type(ours) is type(theirs) and ours.get_vocab() == theirs.get_vocab()
        assert ours.apply_chat_template(text, add_generation_prompt=True) == \
            theirs.apply_chat_template(text, add_generation_prompt=True)
    assert config["tokenizer_class"] in PLAIN_TOKENIZER_CLASSES  # the embedded model's takes the torch-free path
    assert plain_tokenizer_class(embedded_model_dir) == config["tokenizer_class"]
    assert type(model_tokenizer(other)).__name__ not in PLAIN_TOKENIZER_CLASSES  # another class: AutoTokenizer's
    # A generic class for a model type AutoTokenizer gives its own class (Qwen2's), or with code of its own: not taken.
    model_config = json.loads((other / "config.json").read_text())
    for changed in ({**model_config, "model_type": "qwen2"}, {**model_config, "auto_map": {"AutoModel": "x.Y"}}):
        (other / "tokenizer_config.json").write_text(json.dumps(config))
        (other / "config.json").write_text(json.dumps(changed))
        assert plain_tokenizer_class(other) is None
    (other / "config.json").write_text(json.dumps(model_config))
    assert plain_tokenizer_class(other) == config["tokenizer_class"]
    assert model_vocab_size(embedded_model_dir) == AutoConfig.from_pretrained(embedded_model_dir).vocab_size == 49152
    del model_config["vocab_size"]
    (other / "config.json").write_text(json.dumps(model_config))
    assert model_vocab_size(other) == AutoConfig.from_pretrained(other).vocab_size  # the architecture's default


@pytest.mark.parametrize("merged, folded, free_form_mode, free_form_answers, engines", [
    # merged adapter (CPU's default), one-pass scoring, a free-form mode: the shipped artifact as a gateway serves it
    (True, True, True, True, ["adapter", "folded", "free_form"]),
    (True, True, True, False, ["adapter", "folded"]),  # CALM_ANSWERS=multiple_choice: one engine fewer
    # no free-form mode: free form runs on the base weights, unless it is refused
    (True, True, False, True, ["base", "adapter", "folded"]),
    (True, False, False, False, ["adapter"]),
    # no adapter, or the adapter as a vLLM LoRA (CUDA's default): multiple choice runs on the base engine
    (False, True, True, False, ["base", "folded"]),
    (False, False, True, True, ["base", "free_form"]),
    (False, False, False, False, ["base"]),
])
def test_a_version_starts_the_engines_of_the_answers_it_serves(merged, folded, free_form_mode, free_form_answers,
                                                               engines):
    from adapters.clients.inprocess import engine_weights
    from adapters.vllm_plugins.common import EngineConfig

    config = EngineConfig(model_path="base", artifact_path="artifact", merged_model_path="merged" if merged else None,
                          folded_model_path="folded" if folded else None,
                          free_form_model_path="free-form" if free_form_mode else None,
                          free_form_artifact_path="free-form-artifact" if free_form_mode else None,
                          free_form_answers=free_form_answers)
    assert list(engine_weights(config)) == engines


def test_a_multiple_choice_only_gateway_builds_no_copy_of_the_free_form_modes_weights(monkeypatch, shipped_artifact):
    """engine_config, as `calm serve` and every version it loads later use it: with CALM_ANSWERS=multiple_choice the
    free-form mode's weights are neither merged nor served (a retrained mode would otherwise be merged on load)."""
    import calm_cli.serving as serving
    from calm_core.models import resolve_model
    from gateway.settings import GatewaySettings

    merged = []  # the versions whose weights were merged with their adapter

    def merge(base, artifact):
        merged.append(artifact.manifest.artifact_version)
        return f"merged {artifact.manifest.artifact_version}"

    monkeypatch.setattr(serving, "merged_model_dir", merge)
    monkeypatch.setattr(serving, "folded_model_dir", lambda base, artifact: "folded")
    model = resolve_model(None, "float32")
    version, mode = shipped_artifact.manifest.artifact_version, shipped_artifact.free_form.manifest.artifact_version

    def config(**settings):
        merged.clear()
        return serving.engine_config(GatewaySettings(device="cpu", **settings), model, shipped_artifact.path,
                                     shipped_artifact, inprocess=True)

    served = config()
    assert (served.free_form_model_path, served.free_form_answers, sorted(merged)) == (f"merged {mode}", True,
                                                                                      sorted([version, mode]))
    refused = config(answers="multiple_choice")
    assert (refused.free_form_model_path, refused.free_form_artifact_path, refused.free_form_answers) == (None, None, False)
    assert merged == [version] and refused.merged_model_path == f"merged {version}"


@pytest.mark.parametrize("environ", [{}, {"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": "1000"}])
@pytest.mark.parametrize("cpus", [1, 2, 8])
@pytest.mark.parametrize("executor", ["uni", "mp"])
@pytest.mark.parametrize("threads", [None, 1, 2, 4])
def test_the_policy_known_before_counting_is_the_one_every_count_of_engines_gets(monkeypatch, threads, executor, cpus,
                                                                                 environ):
    """The policy a gateway loads its OpenMP runtime with before forking its engines' server (engine_server_fork.py:
    the planned one, else the environment's) is the one InProcessVLLMEngine._share_cores leaves in the environment for
    any number of engines (what a spawned server would load with); where it is not, wait_policy_before_counting says
    so (EngineCountDecides)."""
    import os
    import types

    from adapters.clients import inprocess

    def reported(engines: int) -> str | None:
        for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS"):
            monkeypatch.delenv(name, raising=False)
        for name, value in environ.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setattr(inprocess, "usable_cpus", lambda: cpus)
        engine = types.SimpleNamespace(device="cpu", threads=threads, executor=executor)
        version = types.SimpleNamespace(config=types.SimpleNamespace(engine=engine), threads=None, share_cpus=None,
                                        wait_policy=None)
        inprocess.InProcessVLLMEngine._share_cores(version, engines)
        return os.environ.get("OMP_WAIT_POLICY")  # what a spawned server's runtime would read

    policies = {reported(engines) for engines in range(1, cpus + 2)}
    try:
        planned = wait_policy_before_counting(threads, executor, cpus, environ)
    except EngineCountDecides:
        assert len(policies) == 2, policies
        return
    assert policies == {planned if planned is not None else environ.get("OMP_WAIT_POLICY")}
