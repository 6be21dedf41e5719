"""Everything vLLM loads inside its engine: the α-head logits processor (both model runners), the LoRA resolver, the warm-up middleware, the core share, and the names they share."""
