"""vLLM's async engine inside the gateway process (the embedded default)."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator

from adapters.engine import EngineDelta, EngineRejected, EngineRequest, EngineUnavailable
from adapters.vllm_common import OPT_OUT_KEY, EngineConfig
from calm_core.artifact import load_artifact


def _delta_from_output(out, started: bool) -> EngineDelta:
    completion = out.outputs[0]
    delta = EngineDelta(
        text=completion.text,
        token_ids=list(completion.token_ids),
        finish_reason=completion.finish_reason,
        prompt_tokens=None if started else len(out.prompt_token_ids or []),
    )
    for tok, position in zip(completion.token_ids, completion.logprobs or []):
        delta.token_logprobs.append(float(position[tok].logprob) if tok in position else float("nan"))
        delta.top_logprobs.append({int(t): float(lp.logprob) for t, lp in position.items()})
    return delta


class InProcessVLLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.model_name = config.served_model_name
        self.artifact_version = load_artifact(config.artifact_path).manifest.artifact_version
        self.max_model_len = config.max_model_len
        self._engine = None

    async def start(self) -> None:
        os.environ.update(self.config.env())  # read by the logits processor in the engine-core process
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(**self.config.engine_kwargs(), disable_log_stats=True)
        self._engine = AsyncLLM.from_engine_args(args)

    def _sampling_params(self, request: EngineRequest):
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        kwargs = dict(
            max_tokens=request.max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            seed=request.seed,
            stop=list(request.stop) or None,
            output_kind=RequestOutputKind.DELTA,
            extra_args=None if request.calibrated else {OPT_OUT_KEY: False},
        )
        if request.option_token_ids:
            kwargs.update(allowed_token_ids=list(request.option_token_ids),
                          logprob_token_ids=list(request.option_token_ids))
        elif request.top_logprobs:
            kwargs.update(logprobs=request.top_logprobs)
        else:
            kwargs.update(logprobs=0)  # the sampled token's own log-prob
        return SamplingParams(**kwargs)

    async def stream(self, request: EngineRequest) -> AsyncIterator[EngineDelta]:
        if self._engine is None or self._engine.errored:
            raise EngineUnavailable("the in-process vLLM engine is not running")
        try:
            params = self._sampling_params(request)
        except ValueError as e:
            raise EngineRejected(str(e)) from None
        started = False
        try:
            async for out in self._engine.generate(request.prompt, params, request.request_id):
                yield _delta_from_output(out, started)
                started = True
        except ValueError as e:
            raise EngineRejected(str(e)) from None
        except Exception as e:
            from vllm.v1.engine.exceptions import EngineDeadError

            if isinstance(e, EngineDeadError):
                raise EngineUnavailable(f"the in-process vLLM engine died: {e}") from None
            raise

    async def abort(self, request_id: str) -> None:
        if self._engine is not None:
            await self._engine.abort(request_id)

    async def check_health(self) -> None:
        if self._engine is None:
            raise EngineUnavailable("engine not started")
        try:
            await self._engine.check_health()
        except Exception as e:
            raise EngineUnavailable(f"engine unhealthy: {e}") from None

    async def close(self) -> None:
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
