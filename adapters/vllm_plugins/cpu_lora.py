"""vLLM's LoRA ops on CPU, one matrix product per adapter in the batch instead of a copy of the weights per token
(a vLLM general plugin).

On the CPU platform vLLM applies LoRA with its PyTorch fallback (vllm/lora/ops/torch_ops/lora_ops.py): every `bgmv_*`
gathers `weights[indices]`, one (out x rank) or (rank x in) matrix per token (with a multi-LoRA engine's rank room of
64, ~400 KB per token for a gate/up slice), and multiplies them one by one. Here the tokens of each adapter go through one
product with that adapter's matrix: the same sums, 10-50x less time for 16-512 tokens (benchmarks/engines/
bench_cpu_lora.py), which on a multi-LoRA CPU engine was a fifth of its forward pass.

A token whose index is -1 (a request without an adapter) gets no LoRA delta, as vLLM's GPU kernels and the
`PunicaWrapperBase` documentation have it; vLLM's CPU fallback indexes the last adapter slot with it instead, so a
base-model request batched beside an adapter's would get that slot's delta once every slot is taken (vLLM's open pull
request #48421 fixes it the same way). Everything else (shapes, dtypes, `add_inputs`, the output slices) is vLLM's.

Installed under `vllm.general_plugins` (pyproject.toml), so vLLM calls `register` in each of its processes; it replaces
the functions only on the CPU platform and only where vLLM's have the parameters these expect, else it leaves vLLM's
and logs why (tests/test_cpu_lora.py holds both to vLLM's results and to vLLM's PunicaWrapperCPU).
"""

from __future__ import annotations

import importlib.util
import inspect
import logging

import torch

logger = logging.getLogger(__name__)

_PARAMETERS = {
    "bgmv_shrink": ["inputs", "lora_b_weights", "output_tensor", "lora_indices_tensor", "scaling"],
    "bgmv_expand": ["inputs", "lora_b_weights", "output_tensor", "lora_indices_tensor", "add_inputs"],
    "bgmv_expand_slice": ["inputs", "lora_b_weights", "output_tensor", "lora_indices_tensor", "slice_offset",
                          "slice_size", "add_inputs"],
}


def per_token_products(inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor,
                       dtype: torch.dtype) -> torch.Tensor:
    """Row b: weights[indices[b]] @ inputs[b] (vLLM's `einsum("bi, boi -> bo", inputs, weights[indices])`), zero where
    indices[b] is -1; weights are (adapters, out, in) or (adapters, 1, out, in)."""
    if weights.dim() == 4:
        weights = weights.squeeze(1)
    inputs = inputs.to(dtype)
    if indices.shape[0] != inputs.shape[0]:  # vLLM's own product, which broadcasts one row (or raises)
        outputs = torch.einsum("bi, boi -> bo", inputs, weights[indices.clamp(min=0)].to(dtype))
        return outputs.masked_fill((indices == -1).unsqueeze(1), 0)
    adapters = torch.unique(indices).tolist()
    if len(adapters) == 1 and adapters[0] >= 0:  # the common batch: every token on one adapter
        return inputs @ weights[adapters[0]].to(dtype).T
    out = inputs.new_zeros(inputs.shape[0], weights.shape[1])
    for adapter in adapters:
        if adapter >= 0:
            rows = (indices == adapter).nonzero().squeeze(1)
            out[rows] = inputs[rows] @ weights[adapter].to(dtype).T
    return out


def bgmv_shrink(inputs: torch.Tensor, lora_b_weights: torch.Tensor, output_tensor: torch.Tensor,
                lora_indices_tensor: torch.Tensor, scaling: float = 1.0) -> None:
    outputs = per_token_products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs[:]


def bgmv_expand(inputs: torch.Tensor, lora_b_weights: torch.Tensor, output_tensor: torch.Tensor,
                lora_indices_tensor: torch.Tensor, add_inputs: bool = True) -> None:
    outputs = per_token_products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    # vLLM's rule: a single row of products is added to (or written over) every output row.
    limit = 1 if outputs.shape[0] == 1 and output_tensor.shape[0] != 1 else output_tensor.shape[0]
    common_len = min(outputs.shape[1], output_tensor.shape[1])
    if add_inputs:
        output_tensor[:, :common_len] += outputs[:limit, :common_len]
    else:
        output_tensor[:, :common_len] = outputs[:limit, :common_len]


def bgmv_expand_slice(inputs: torch.Tensor, lora_b_weights: torch.Tensor, output_tensor: torch.Tensor,
                      lora_indices_tensor: torch.Tensor, slice_offset: int, slice_size: int,
                      add_inputs: bool = True) -> None:
    outputs = per_token_products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    # add_inputs=False writes zeros to the rows without an adapter (vLLM's GPU kernels leave them): its one caller,
    # vLLM's CUDA dual-stream path, starts from a zeroed buffer, so the two agree.
    if add_inputs:
        output_tensor[:, slice_offset: slice_offset + slice_size] += outputs[:]
    else:
        output_tensor[:, slice_offset: slice_offset + slice_size] = outputs[:]


def holders() -> tuple:
    """Where vLLM's CPU path finds these functions: its ops module (its `sgmv_*` call the `bgmv_*` found there), the
    package that re-exports them, and the CPU Punica wrapper, which imported them by name."""
    from vllm.lora.ops import torch_ops
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    return lora_ops, torch_ops, punica_cpu


def vllms_ops():
    """vLLM's fallback ops as it ships them: a second copy of its module, read from vLLM's file, whatever install()
    replaced in this process (the tests' and the benchmark's reference)."""
    lora_ops = holders()[0]
    spec = importlib.util.spec_from_file_location("vllm_lora_ops_as_shipped", lora_ops.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def install() -> bool:
    """Put these in place of vLLM's CPU fallback wherever it is found (`holders`). False, vLLM's left, where vLLM's
    differ from what these replace."""
    modules = holders()
    ours = {name: globals()[name] for name in _PARAMETERS}
    for name, parameters in _PARAMETERS.items():
        theirs = getattr(modules[0], name, None)
        if theirs is not ours[name] and (theirs is None or list(inspect.signature(theirs).parameters) != parameters):
            logger.warning("vLLM's %s is not the one CALM's CPU LoRA ops replace: vLLM's kept", name)
            return False
    for name, function in ours.items():
        for module in modules:
            if hasattr(module, name):
                setattr(module, name, function)
    logger.info("vLLM's CPU LoRA ops: one product per adapter (adapters/vllm_plugins/cpu_lora.py)")
    return True


def register() -> None:
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        install()
