"""Protocol models per endpoint group (pydantic only, no logic), as vLLM's entrypoints keep them."""
