"""The first module the engine-core server imports (engine_processes.PRELOAD): the collector set as a `calm` command's
before vLLM's modules load (calm_core/collector.py says why). The engine cores forked from it serve with CPython's
setting again (EnvCarryingProcess.run), as spawned ones did: how vLLM's engine loop fares with the other was not measured."""

from calm_core.collector import collect_young_less_often

collect_young_less_often()
