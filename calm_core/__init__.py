"""Shared core of CALM Gateway: alpha-head math and artifact format, calibration metrics, data schema.

Nothing here imports vLLM or FastAPI; both `training` and `adapters`/`gateway` build on it.
"""

__version__ = "0.1.0"
