"""Where a trained artifact meets an engine: the vLLM α-head logits processor and the engine clients."""
