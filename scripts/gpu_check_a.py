"""Part (a) of the GPU check, for a lent GPU machine without vLLM (torch, transformers, peft, accelerate; what else it
needs is carried there by scripts/gpu_carry.sh, and `bash scripts/gpu_check.sh a` runs this). A few minutes on one GPU:

1. the α head's table (adapters/vllm_plugins/alpha_heads.py, what the V2 processor applies) on CUDA logits against d ⊙ z + l
   computed in float64 on the host: one head for the whole batch and a mixed batch, float32 and bfloat16 logits;
2. `calm train` of the embedded model (configs/train/smoke.toml) on CUDA in float32 and bfloat16, its evaluation and
   its head beside the same configuration trained on a CPU (the reference carried from the developer machine);
3. the offline engine's bf16 budget: option probabilities of the embedded model in bfloat16 on CUDA against float32
   on the host, within BF16_BUDGET (adapters/hosting/engine_settings.py).

    python scripts/gpu_check_a.py --reference .gpu-carry/1/reference --out DIR   # writes DIR/gpu_check_a.{md,json}
    python scripts/gpu_check_a.py --make-reference DIR    # on the CPU machine: the smoke run part (a) compares with
    python scripts/gpu_check_a.py --device cpu ...        # a dry run of the script's own logic, without a GPU
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from adapters.vllm_plugins.alpha_heads import HeadTable
from adapters.hosting.engine_settings import BF16_BUDGET
from calm_core.artifact import load_artifact
from calm_core.data import load_mc
from calm_core.models import prepare_embedded
from training.artifact_scoring import load_served_model, option_probabilities
from training.config import load_config
from training.scoring import load_tokenizer
from training.trainer import Trainer

SMOKE = "configs/train/smoke.toml"


def head_table_on(device: str, vocab: int = 49152, rows: int = 64) -> list[dict]:
    gen = np.random.default_rng(0)
    heads = [(np.exp(gen.normal(size=vocab) * 0.3).astype(np.float32), gen.normal(size=vocab).astype(np.float32))
             for _ in range(3)]
    table = HeadTable(torch.device(device), vocab)
    index = [table.add(s, b) for s, b in heads]
    out = []
    for dtype in (torch.float32, torch.bfloat16):
        for name, batch in (("one head", np.full(rows, index[1])), ("mixed", gen.choice([0, *index], size=rows))):
            logits = torch.randn(rows, vocab, dtype=dtype, device=device)
            want = logits.double().cpu()
            for r, h in enumerate(batch):
                if h:
                    scale, shift = heads[index.index(h)]
                    want[r] = want[r] * torch.from_numpy(scale).double() + torch.from_numpy(shift).double()
            got = table.apply(logits.clone(), batch, lambda: torch.as_tensor(batch, device=device)).double().cpu()
            error = float((got - want).abs().max())
            tolerance = 1e-4 if dtype == torch.float32 else 0.1  # bf16 rounds the product (8 bits of mantissa)
            out.append(dict(dtype=str(dtype).removeprefix("torch."), batch=name, max_abs_error=error, ok=error < tolerance))
    return out


def train_smoke(dtype: str, out: Path) -> dict:
    """The smoke configuration trained where the trainer runs (a GPU where torch sees one), evaluated and exported."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()  # each run's own peak
    start = time.perf_counter()
    trainer = Trainer(load_config(SMOKE, out_dir=str(out), dtype=dtype), show_progress=False).setup()
    trainer.train()
    metrics = trainer.evaluate()
    path = trainer.export(metrics)
    peak = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else float("nan")
    return dict(dtype=dtype, device=str(trainer.device), artifact=str(path), seconds=time.perf_counter() - start,
                peak_mib=peak, metrics=metrics)


def compare_heads(artifact: str, reference: str) -> dict:
    ours, theirs = load_artifact(artifact).head, load_artifact(reference).head
    return dict(max_abs_log_scale=float(np.abs(np.log(ours.scale) - np.log(theirs.scale)).max()),
                max_abs_shift=float(np.abs(ours.shift - theirs.shift).max()))


def bf16_budget(device: str, questions: int = 48) -> dict:
    path = str(prepare_embedded("float32"))
    tokenizer = load_tokenizer(path)
    qs = load_mc("arc_easy", "test")[:questions]
    host = option_probabilities(load_served_model(path, None, "float32"), tokenizer, qs, "cloze", None)
    cuda = option_probabilities(load_served_model(path, None, "bfloat16").to(device), tokenizer, qs, "cloze", None)
    error = float(np.abs(host - cuda).max())
    return dict(device=device, questions=questions, max_abs_error=error, budget=BF16_BUDGET["option_probability"],
                ok=error <= BF16_BUDGET["option_probability"])


def markdown(result: dict) -> str:
    lines = [f"GPU check part (a), {result['device']}, torch {result['torch']}", "",
             "| head table | dtype | max abs error | ok |", "|---|---|---:|---|"]
    lines += [f"| {r['batch']} | {r['dtype']} | {r['max_abs_error']:.2e} | {r['ok']} |" for r in result["head_table"]]
    lines += ["", "| smoke training | test set | accuracy | ECE-10 | AUROC |", "|---|---|---:|---:|---:|"]
    for run in result["training"]:
        for label, m in run["metrics"].items():
            lines.append(f"| {run['dtype']} ({run['device']}) | {label} | {m['accuracy']:.3f} | "
                         f"{m['ece_10']:.3f} | {m['auroc']:.3f} |")
    lines += ["", "| head against the CPU-trained one | max abs log d | max abs l | seconds | peak MiB |",
              "|---|---:|---:|---:|---:|"]
    for run in result["training"]:
        if "head_vs_cpu" in run:
            h = run["head_vs_cpu"]
            lines.append(f"| {run['dtype']} | {h['max_abs_log_scale']:.2e} | {h['max_abs_shift']:.2e} | "
                         f"{run['seconds']:.0f} | {run['peak_mib']:.0f} |")
    b = result["bf16_budget"]
    lines += ["", f"Offline engine in bf16 on {b['device']} against float32 on the host, {b['questions']} questions: largest "
                  f"option-probability error {b['max_abs_error']:.4f} (budget {b['budget']}): {b['ok']}"]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reference", type=Path, help="the CPU smoke run's folder (gpu_carry.sh makes it)")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--make-reference", type=Path, help="train the CPU reference into this folder and stop")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    if args.make_reference:
        run = train_smoke("float32", args.make_reference)
        (args.make_reference / "metrics.json").write_text(json.dumps(run["metrics"], indent=2))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu (dry run)"
    result = dict(device=name, torch=torch.__version__, head_table=head_table_on(args.device))
    print(json.dumps(result["head_table"]), flush=True)
    reference = json.loads((args.reference / "metrics.json").read_text())
    result["training"] = [dict(dtype="float32", device="cpu, reference", metrics=reference)]
    for dtype in ("float32", "bfloat16"):
        run = train_smoke(dtype, args.out / f"train-{dtype}")
        run["head_vs_cpu"] = compare_heads(run["artifact"], str(args.reference / "artifact"))
        result["training"].append(run)
        print(json.dumps(run), flush=True)
    result["bf16_budget"] = bf16_budget(args.device)
    (args.out / "gpu_check_a.json").write_text(json.dumps(result, indent=2))
    (args.out / "gpu_check_a.md").write_text(markdown(result))
    print(markdown(result))


if __name__ == "__main__":
    main()
