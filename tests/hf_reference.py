"""Reference numbers from HF transformers, computed the plain way (one full forward per prompt + option), for checking
what the gateway returns through vLLM."""

from __future__ import annotations

import numpy as np
import torch

from calm_core.prompts import cloze_tokens


@torch.inference_mode()
def cloze_option_scores(model, tokenizer, question: str, choices, scale=1.0, shift=0.0) -> np.ndarray:
    """Each option's mean token log-prob under log softmax(d ⊙ z + l), one full forward of prompt + option each."""
    tokens = cloze_tokens(tokenizer, question, choices)
    scale, shift = torch.as_tensor(scale, dtype=torch.float32), torch.as_tensor(shift, dtype=torch.float32)
    scores = []
    for option in tokens.options:
        ids = torch.tensor([tokens.prompt + option])
        logits = model(input_ids=ids).logits[0, len(tokens.prompt) - 1 : -1].float()
        logp = torch.log_softmax(logits * scale + shift, -1)
        scores.append(float(logp.gather(1, torch.tensor(option)[:, None]).mean()))
    return np.array(scores, dtype=np.float64)


def cloze_option_probs(model, tokenizer, question: str, choices, scale=1.0, shift=0.0) -> np.ndarray:
    """softmax over the options of their cloze scores."""
    s = cloze_option_scores(model, tokenizer, question, choices, scale, shift)
    p = np.exp(s - s.max())
    return p / p.sum()


def option_tolerances(gateway_url: str) -> tuple[float, float]:
    """(option probabilities, raw confidence) tolerances against these fp32 numbers for the engine's dtype in force:
    1e-3 in fp32, the bf16 budget otherwise."""
    from tests.servers import http

    from adapters.hosting.engine_settings import BF16_BUDGET

    dtype = http.get(f"{gateway_url}/health", headers={"Authorization": "Bearer dev-admin-key"}, timeout=30).json()["engine"].get("dtype", "float32")
    if dtype == "float32":
        return 1e-3, 1e-3
    return BF16_BUDGET["option_probability"], BF16_BUDGET["raw_confidence"]


def greedy_free_form(model, tokenizer, question: str, scale, shift, max_tokens: int = 48):
    """A free-form answer as the gateway serves it: greedy under the served weights' own distribution (the head only
    scores it; HF's KV cache), as (answer token ids, calibrated log-probs, raw log-probs), end-of-turn token
    included."""
    from training.generative import encode_text, free_form_prompt

    scale, shift = torch.as_tensor(scale), torch.as_tensor(shift)
    prompt = list(encode_text(tokenizer, free_form_prompt(tokenizer, question)))
    ids, calibrated, raw = list(prompt), [], []
    with torch.no_grad():
        out = model(input_ids=torch.tensor([ids]), use_cache=True)
        for _ in range(max_tokens):
            z = out.logits[0, -1].float()
            logp, own = torch.log_softmax(z * scale + shift, -1), torch.log_softmax(z, -1)
            token = int(own.argmax())
            calibrated.append(float(logp[token]))
            raw.append(float(own[token]))
            ids.append(token)
            if token == tokenizer.eos_token_id:
                break
            out = model(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
    return ids[len(prompt):], calibrated, raw


def free_form_logprobs(model, tokenizer, question: str, answer: list[int], scale, shift,
                       temperature: float = 1.0) -> tuple[list[float], list[float]]:
    """A given answer's tokens read back (teacher forcing): (calibrated log-probs at temperature 1, the weights' own
    log-probs at `temperature`)."""
    from training.generative import encode_text, free_form_prompt

    prompt = list(encode_text(tokenizer, free_form_prompt(tokenizer, question)))
    with torch.no_grad():
        z = model(input_ids=torch.tensor([prompt + list(answer)])).logits[0, len(prompt) - 1 : -1].float()
    target = torch.tensor(answer)[:, None]
    calibrated = torch.log_softmax(z * torch.as_tensor(scale) + torch.as_tensor(shift), -1).gather(1, target)[:, 0]
    return calibrated.tolist(), torch.log_softmax(z / temperature, -1).gather(1, target)[:, 0].tolist()
