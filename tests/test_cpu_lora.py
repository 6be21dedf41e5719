"""adapters/vllm_plugins/cpu_lora.py held to vLLM's own: the numbers of vLLM's CPU fallback ops (a second copy of its
module, loaded from vLLM's file, so what the plugin replaced in this process stays replaced) for every token with an
adapter, none for a token without one, and vLLM's CPU Punica wrapper applying each request's adapter through them."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch
from vllm.lora.layers.utils import LoRAMapping
from vllm.lora.ops.torch_ops import lora_ops
from vllm.lora.punica_wrapper import punica_cpu

from adapters.vllm_plugins import cpu_lora
from adapters.vllm_plugins.cpu_lora import holders, vllms_ops


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


def test_other_dtypes_int32_indices_and_an_empty_batch_as_vllms():
    theirs = vllms_ops()
    x, w, y, idx = case(5, 6, 10, [0, 2, 2, 1, 0], True)
    for inputs, weights, out, indices in ((x.bfloat16(), w, y, idx), (x, w.bfloat16(), y, idx.int()),
                                          (x, w, y.bfloat16(), idx), (x[:0], w, y[:0], idx[:0])):
        expected, got = out.clone(), out.clone()
        theirs.bgmv_expand(inputs, weights, expected, indices, True)
        cpu_lora.bgmv_expand(inputs, weights, got, indices, True)
        torch.testing.assert_close(got, expected, rtol=1e-2 if got.dtype == torch.bfloat16 else 1e-5, atol=1e-2 if
                                   got.dtype == torch.bfloat16 else 1e-5)


def test_indices_of_another_length_than_the_inputs_take_vllms_product():
    """One input row and three indices: vLLM's product broadcasts the row, ours too (a row without an adapter: none);
    three rows and two indices: vLLM's raises, ours too."""
    theirs = vllms_ops()
    x, w, _, _ = case(1, 6, 10, [0], True)
    expected, got = torch.zeros(3, 6), torch.zeros(3, 6)
    theirs.bgmv_shrink(x, w, expected, torch.tensor([0, 2, 1]), 1.0)
    cpu_lora.bgmv_shrink(x, w, got, torch.tensor([0, 2, 1]), 1.0)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    cpu_lora.bgmv_shrink(x, w, got, torch.tensor([0, -1, 1]), 1.0)
    assert torch.equal(got[1], torch.zeros(6)) and torch.allclose(got[2], expected[2])
    with pytest.raises(RuntimeError):
        theirs.bgmv_shrink(torch.randn(3, 10), w, torch.zeros(3, 6), torch.tensor([0, 1]), 1.0)
    with pytest.raises(RuntimeError):
        cpu_lora.bgmv_shrink(torch.randn(3, 10), w, torch.zeros(3, 6), torch.tensor([0, 1]), 1.0)


def keep_vllms_names(monkeypatch) -> None:
    """Whatever this process has in the three modules install() writes to comes back after the test."""
    for module in holders():
        for name in cpu_lora._PARAMETERS:
            monkeypatch.setattr(module, name, getattr(module, name))


@pytest.fixture
def installed(monkeypatch):
    keep_vllms_names(monkeypatch)
    assert cpu_lora.install()
    assert all(getattr(m, name) is getattr(cpu_lora, name) for m in holders() for name in cpu_lora._PARAMETERS)


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


def test_lora_on_the_lm_head_gives_a_base_request_none(installed):
    """The logits' LoRA goes by request (sampler indices): adapter 9's request gets its delta, the base one none."""
    wrapper = punica_cpu.PunicaWrapperCPU(max_num_batched_tokens=64, max_batches=8, device="cpu")
    tokens = (0, 0, 9, 9, 9)
    wrapper.update_metadata(LoRAMapping(index_mapping=tokens, prompt_mapping=(0, 9), is_prefill=True), [7, 9], 2, 1000)
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(2, 16, generator=g), torch.randn(2, 30, generator=g)
    a, b = torch.randn(2, 1, 4, 16, generator=g), torch.randn(2, 1, 30, 4, generator=g)
    before = y.clone()
    wrapper.add_lora_logits(y, x, a, b, 0.5)
    assert torch.equal(y[0], before[0])
    torch.testing.assert_close(y[1], before[1] + 0.5 * (b[1, 0] @ (a[1, 0] @ x[1])), rtol=1e-5, atol=1e-5)


def test_install_keeps_vllms_ops_where_their_parameters_differ(monkeypatch):
    def changed(inputs, weights, output, indices, scaling, extra):
        raise AssertionError("not called")

    keep_vllms_names(monkeypatch)
    theirs = vllms_ops()
    for module in holders():
        for name in cpu_lora._PARAMETERS:
            setattr(module, name, getattr(theirs, name))
    lora_ops.bgmv_shrink = changed
    assert cpu_lora.install() is False
    assert lora_ops.bgmv_shrink is changed
    assert all(getattr(m, name) is getattr(theirs, name) for m in holders()[1:] for name in cpu_lora._PARAMETERS)


def test_vllm_finds_the_plugin_among_its_general_plugins():
    plugins = {e.name: e.value for e in importlib.metadata.entry_points(group="vllm.general_plugins")}
    assert plugins.get("calm_cpu_lora") == "adapters.vllm_plugins.cpu_lora:register"
