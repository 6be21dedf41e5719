#!/usr/bin/env bash
# What part (a) of the GPU check (scripts/gpu_check.sh a) needs on a lent GPU machine, made here: that machine has
# Python 3.12 with torch, transformers, peft and accelerate, cannot fetch anything, and takes at most 64 MiB (the
# checkout included) per call. So: wheels of the other packages the training path imports, built for its Python; the
# benchmark questions of the smoke split; the CPU-trained reference (configs/train/smoke.toml on this machine, a few
# minutes); and the embedded model's GGUF cut in three, one part per call:
#   bash scripts/gpu_carry.sh
#   device run, carry [".gpu-carry/1"], command "ls .gpu-carry"          # the machine keeps what a call carried ...
#   device run, carry [".gpu-carry/2"], command "ls .gpu-carry"          # ... while warm (30 s): call again at once
#   device run, carry [".gpu-carry/3"], command "bash scripts/gpu_check.sh a", timeout 540
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
CARRY=.gpu-carry
rm -rf "$CARRY"
mkdir -p "$CARRY"/1/wheels "$CARRY"/1/data "$CARRY"/2 "$CARRY"/3
# The versions this environment runs, for the lent machine's CPython 3.12 on x86-64.
mapfile -t PINS < <("$PY" -m pip freeze | grep -i -E "^(pydantic|pydantic[-_]core|annotated[-_]types|typing[-_]inspection|sqlalchemy|greenlet|gguf)==")
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$CARRY/1/wheels" "${PINS[@]}"
DATA=$("$PY" -c "from calm_core.paths import data_dir; print(data_dir())")
for f in arc_easy/arc_easy_dev.jsonl arc_easy/arc_easy_test.jsonl commonsenseqa/commonsenseqa_dev.jsonl; do
  mkdir -p "$CARRY/1/data/$(dirname "$f")"
  cp "$DATA/$f" "$CARRY/1/data/$f"
done
GGUF=$("$PY" -c "from calm_core.models import embedded_gguf_path; print(embedded_gguf_path())")
split -n 3 -d "$GGUF" "$CARRY/part."
mv "$CARRY/part.00" "$CARRY/1/"; mv "$CARRY/part.01" "$CARRY/2/"; mv "$CARRY/part.02" "$CARRY/3/"
(cd "$(dirname "$GGUF")" && sha256sum "$(basename "$GGUF")") > "$CARRY/3/gguf.sha256"
CALM_DATA_DIR="$PWD/$CARRY/1/data" "$PY" scripts/gpu_check_a.py --make-reference "$CARRY/1/reference"
rm -rf "$CARRY/1/reference/checkpoint.pt"
du -sh "$CARRY"/*
