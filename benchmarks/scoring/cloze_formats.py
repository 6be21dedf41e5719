"""Zero-shot option scoring of the embedded model in two cloze layouts, mean vs summed token log-likelihood.

    python benchmarks/scoring/cloze_formats.py [--n 200] [--out benchmarks/results]

chat:  the question as the user's turn under the chat template, the option as the assistant's answer
plain: "Question: ...\\nAnswer:" followed by " <option>" (what `calm_core.prompts.cloze_prompt` uses)
Prints accuracy, ECE-10, AUROC and mean confidence per dataset and their means over the datasets (the same seeded 200
questions for every layout) and writes them to cloze_formats.md in --out (docs/training.md's copy).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from calm_core.scoring import option_probs  # noqa: E402
from calm_core.data import load_mc  # noqa: E402
from calm_core.metrics import calibration_report  # noqa: E402
from calm_core.models import resolve_model  # noqa: E402
from calm_core.prompts import ClozeTokens, cloze_option, cloze_prompt, render_chat  # noqa: E402
from training import cloze  # noqa: E402
from training.scoring import load_hf_model  # noqa: E402

DATASETS = (("arc_easy", "test"), ("arc_challenge", "test"), ("openbookqa", "test"), ("commonsenseqa", "dev"))
LAYOUTS = {
    "chat": (lambda tok, q: render_chat(tok, [{"role": "user", "content": q.question.strip()}]), lambda c: c.strip()),
    "plain": (lambda tok, q: cloze_prompt(q.question), cloze_option),
}


def scores(model, tokenizer, questions, layout: str, width: int) -> dict[str, np.ndarray]:
    prompt_of, option_of = LAYOUTS[layout]
    encode = lambda text: tuple(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    items = [cloze.pack_question(ClozeTokens(encode(prompt_of(tokenizer, q)), tuple(encode(option_of(c)) for c in q.choices)))
             for q in questions]
    first = model.config.num_hidden_layers
    cloze.encode_packed(model, items, first)
    out = {"mean": [], "sum": []}
    with torch.no_grad():
        for start in range(0, len(items), 32):
            raw = cloze.token_logits(model, items[start : start + 32], first, width, "cpu")
            logp = torch.log_softmax(raw.logits, -1).gather(1, raw.targets[:, None]).squeeze(1)
            n = raw.rows * raw.width
            sums = logp.new_zeros(n).index_add(0, raw.slot, logp)
            counts = logp.new_zeros(n).index_add(0, raw.slot, torch.ones_like(logp)).clamp(min=1)
            out["sum"].append(sums.view(raw.rows, width))
            out["mean"].append((sums / counts).view(raw.rows, width))
    return {k: torch.cat(v).double().numpy() for k, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = parser.parse_args()
    model, tokenizer = load_hf_model(resolve_model(None).path)
    lines = ["| dataset | layout | norm | accuracy | ECE-10 | AUROC | mean conf. |", "|---|---|---|---|---|---|---|"]
    print("\n".join(lines))
    means: dict[tuple[str, str], list[np.ndarray]] = {}
    for name, split in DATASETS:
        questions = load_mc(name, split)
        rng = np.random.default_rng(0)
        questions = [questions[i] for i in rng.choice(len(questions), min(args.n, len(questions)), replace=False)]
        n_options = np.array([q.n_options for q in questions])
        labels = np.array([q.answer for q in questions])
        for layout in LAYOUTS:
            for norm, z in scores(model, tokenizer, questions, layout, int(n_options.max())).items():
                r = calibration_report(option_probs(z, n_options), labels, n_boot=1).as_dict()
                row = [r["accuracy"], r["ece_10"], r["auroc"], r["mean_confidence"]]
                means.setdefault((layout, norm), []).append(np.array(row))
                lines.append(f"| {name} | {layout} | {norm} | " + " | ".join(f"{v:.3f}" for v in row) + " |")
                print(lines[-1], flush=True)
    for (layout, norm), rows in means.items():
        lines.append(f"| **mean of {len(rows)}** | {layout} | {norm} | "
                     + " | ".join(f"**{v:.3f}**" for v in np.mean(rows, axis=0)) + " |")
    text = (f"Zero-shot, the embedded model, {args.n} seeded questions per set (`python benchmarks/scoring/cloze_formats.py`):"
            "\n\n" + "\n".join(lines))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cloze_formats.md").write_text(text + "\n")
    print("\n".join(lines[-len(means):]))


if __name__ == "__main__":
    main()
