"""Online half of CALM Gateway: OpenAI-compatible API with calibrated confidence, policies, metrics, feedback."""
