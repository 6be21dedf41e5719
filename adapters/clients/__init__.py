"""Engine clients behind the engine seam (calm_core/engine.py): vLLM in this process, or vLLM OpenAI servers over HTTP."""
