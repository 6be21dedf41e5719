"""adapters/vllm_plugins/cpu_lora.py held to vLLM's own: the numbers of vLLM's CPU fallback ops (a second copy of its
module, loaded from vLLM's file, so what the plugin replaced in this process stays replaced) for every token with an
adapter, none for a token without one, and vLLM's CPU Punica wrapper applying each request's adapter through them."""

from __future__ import annotations

import importlib.metadata
import importlib.util

import pytest
import torch
from vllm.lora.layers.utils import LoRAMapping
from vllm.lora.ops.torch_ops import lora_ops
from vllm.lora.punica_wrapper import punica_cpu

from adapters.vllm_plugins import cpu_lora


def vllms_ops():
    spec = importlib.util.spec_from_file_location("vllm_lora_ops_as_shipped", lora_ops.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def case(tokens: int, out: int, inner: int, indices: list[int], four_dims: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    slots = 3
    shape = (slots, 1, out, inner) if four_dims else (slots, out, inner)
    return (torch.randn(tokens, inner, generator=g), torch.randn(*shape, generator=g),
            torch.randn(tokens, out + 5, generator=g), torch.tensor(indices, dtype=torch.long))


BATCHES = {"one adapter": [1] * 7, "three adapters": [2, 0, 0, 1, 2, 1, 0], "one token": [2]}


@pytest.mark.parametrize("four_dims", [True, False])
@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("add_inputs", [True, False])
def test_each_op_gives_vllms_numbers_for_tokens_with_an_adapter(batch, four_dims, add_inputs):
    theirs = vllms_ops()
    indices = BATCHES[batch]
    x, w, y, idx = case(len(indices), 6, 10, indices, four_dims)
    calls = {
        "bgmv_shrink": lambda ops, y: ops.bgmv_shrink(x, w, y, idx, 0.5),
        "bgmv_expand": lambda ops, y: ops.bgmv_expand(x, w, y, idx, add_inputs),
        "bgmv_expand_slice": lambda ops, y: ops.bgmv_expand_slice(x, w, y, idx, 3, 6, add_inputs),
    }
    for name, call in calls.items():
        expected, got = y.clone(), y.clone()
        call(theirs, expected)
        call(cpu_lora, got)
        assert not torch.equal(expected, y), name  # the op wrote something
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=name)


def test_expand_of_one_row_adds_it_to_every_output_row_as_vllms_does():
    theirs = vllms_ops()
    x, w, y, idx = case(1, 6, 10, [0], True)
    y = torch.randn(4, 6)
    expected, got = y.clone(), y.clone()
    theirs.bgmv_expand(x, w, expected, idx, True)
    cpu_lora.bgmv_expand(x, w, got, idx, True)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    delta = got - y
    torch.testing.assert_close(delta, delta[:1].expand(4, 6), rtol=1e-6, atol=1e-6)
    assert delta.abs().min() > 0


def test_a_token_without_an_adapter_gets_no_delta_where_vllms_fallback_gives_it_the_last_slots():
    theirs = vllms_ops()
    indices = [0, -1, 2, -1, 1]
    x, w, y, idx = case(len(indices), 6, 10, indices, True)
    expected, got = y.clone(), y.clone()
    theirs.bgmv_expand(x, w, expected, idx, True)
    cpu_lora.bgmv_expand(x, w, got, idx, True)
    base = idx == -1
    assert torch.equal(got[base], y[base])
    torch.testing.assert_close(got[~base], expected[~base], rtol=1e-5, atol=1e-5)
    # vLLM 0.32's: slot 2's delta (if this fails, vLLM skips -1 itself: the module's docstring is out of date).
    assert not torch.allclose(expected[base], y[base])
    shrunk = torch.full((len(indices), 6), 7.0)
    cpu_lora.bgmv_shrink(x, w, shrunk, idx, 1.0)
    assert torch.equal(shrunk[base], torch.zeros(2, 6))
    everything_base = torch.full((3, 6 + 5), 7.0)
    cpu_lora.bgmv_expand(x[:3], w, everything_base, torch.tensor([-1, -1, -1]), True)
    assert torch.equal(everything_base, torch.full((3, 11), 7.0))


@pytest.fixture
def installed(monkeypatch):
    for module in (lora_ops, punica_cpu):  # restored after the test, whatever this process had
        for name in cpu_lora._PARAMETERS:
            monkeypatch.setattr(module, name, getattr(module, name))
    assert cpu_lora.install()


@pytest.mark.parametrize("prefill", [True, False])
def test_vllms_cpu_punica_wrapper_applies_each_requests_adapter_and_none_to_a_base_request(installed, prefill):
    """Three requests (base, adapter 7, adapter 9) in one batch on an engine whose two slots are both taken; vLLM's own
    ops gave the base request adapter 9's delta (measured: up to 13 off), ours none."""
    assert lora_ops.bgmv_shrink is cpu_lora.bgmv_shrink and punica_cpu.bgmv_expand_slice is cpu_lora.bgmv_expand_slice
    wrapper = punica_cpu.PunicaWrapperCPU(max_num_batched_tokens=64, max_batches=8, device="cpu")
    tokens = (0, 0, 0, 7, 7, 7, 7, 9, 9)
    wrapper.update_metadata(LoRAMapping(index_mapping=tokens, prompt_mapping=(0, 7, 9) if prefill else tokens,
                                        is_prefill=prefill), [7, 9], 2, 1000)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(9, 16, generator=g), torch.randn(9, 12, generator=g)
    a, b = torch.randn(2, 1, 4, 16, generator=g), torch.randn(2, 1, 12, 4, generator=g)
    before = y.clone()
    wrapper.add_lora_linear(y, x, (a,), (b,), 0.5, (12,))
    slot = {0: None, 7: 0, 9: 1}
    for row, lora_id in enumerate(tokens):
        s = slot[lora_id]
        expected = before[row] if s is None else before[row] + 0.5 * (b[s, 0] @ (a[s, 0] @ x[row]))
        torch.testing.assert_close(y[row], expected, rtol=1e-5, atol=1e-5)


def test_install_keeps_vllms_ops_where_their_parameters_differ(monkeypatch):
    def changed(inputs, weights, output, indices, scaling, extra):
        raise AssertionError("not called")

    theirs = vllms_ops()
    monkeypatch.setattr(lora_ops, "bgmv_shrink", changed)
    for module in (lora_ops, punica_cpu):
        monkeypatch.setattr(module, "bgmv_expand", theirs.bgmv_expand)
    assert cpu_lora.install() is False
    assert lora_ops.bgmv_shrink is changed
    assert lora_ops.bgmv_expand is theirs.bgmv_expand and punica_cpu.bgmv_expand is theirs.bgmv_expand


def test_vllm_finds_the_plugin_among_its_general_plugins():
    plugins = {e.name: e.value for e in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert plugins.get("calm_cpu_lora") == "adapters.vllm_plugins.cpu_lora:register"
