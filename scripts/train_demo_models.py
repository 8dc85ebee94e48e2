"""Train the shipped demo models: `demo-hybrid` (LFM2-style: short conv + attention) and
`demo-mamba` (Mamba2), byte-level, on the corpus of `demo_corpus.py` (no download).

    python scripts/train_demo_models.py --model demo-hybrid        # or demo-mamba, or all

Seeded and resumable (a checkpoint every `--save-every` steps in `--work-dir`; rerun the same
command to continue), a progress bar with the loss, CPU by default (CUDA when present). Training
uses HF transformers' model classes, the reference our runner must match; the artifact is the HF
folder written to `toolkit/models/demo/<name>/` with the loss curve (PNG + CSV) and the corpus
description (sizes and hashes) beside it.
"""
from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo_corpus import build_corpus, describe

REPO = Path(__file__).resolve().parents[1]
OUT_ROOT = REPO / "toolkit" / "models" / "demo"
VOCAB = 264          # pad/bos/eos 0/1/2 + 256 bytes at 3..258, rounded up to a multiple of 8


def hybrid_config():
    from transformers import Lfm2Config
    # LFM2 because its recurrent mixer (a gated short convolution) trains fast on a CPU with plain
    # torch, and LFM2 is a hybrid people serve; attention at layers 2 and 5 of 6.
    return Lfm2Config(
        vocab_size=VOCAB, hidden_size=192, intermediate_size=384, block_auto_adjust_ff_dim=False,
        num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2, conv_L_cache=3,
        layer_types=["conv", "conv", "full_attention", "conv", "conv", "full_attention"],
        max_position_embeddings=2048, rope_theta=10000.0, tie_word_embeddings=True,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.02,
        architectures=["Lfm2ForCausalLM"])


def mamba_config():
    from transformers import Mamba2Config
    return Mamba2Config(
        vocab_size=VOCAB, hidden_size=192, num_hidden_layers=8, expand=2, head_dim=32, num_heads=12,
        state_size=32, n_groups=1, conv_kernel=4, chunk_size=64, tie_word_embeddings=True,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.02,
        architectures=["Mamba2ForCausalLM"])


CONFIGS = {"demo-hybrid": hybrid_config, "demo-mamba": mamba_config}


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(total - warmup, 1)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


@torch.no_grad()
def bits_per_byte(model, tokens: np.ndarray, seq_len: int, device: torch.device,
                  max_windows: int | None = None) -> float:
    """Mean next-token loss over non-overlapping windows, in bits (one token = one byte)."""
    model.eval()
    n = (len(tokens) - 1) // seq_len
    if max_windows is not None:
        n = min(n, max_windows)
    total, count = 0.0, 0
    for i in range(0, n, 8):
        rows = [tokens[j * seq_len:(j + 1) * seq_len + 1] for j in range(i, min(i + 8, n))]
        batch = torch.from_numpy(np.stack(rows)).to(device)
        logits = model(input_ids=batch[:, :-1]).logits.float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 batch[:, 1:].reshape(-1), reduction="sum")
        total += loss.item()
        count += batch[:, 1:].numel()
    model.train()
    return total / count / math.log(2)


def train(name: str, args: argparse.Namespace) -> None:
    from transformers import AutoModelForCausalLM
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    torch.manual_seed(args.seed)
    corpus = build_corpus()
    train_tokens = corpus["train"].tokens()
    heldout = corpus["heldout_topics"].tokens()
    config = CONFIGS[name]()
    model = AutoModelForCausalLM.from_config(config).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    work = Path(args.work_dir) / name
    work.mkdir(parents=True, exist_ok=True)
    ckpt_path = work / "resume.pt"
    step, log = 0, []
    gen = torch.Generator().manual_seed(args.seed)
    if ckpt_path.exists():                     # resume: model, optimiser, data order, log
        ckpt = torch.load(ckpt_path, map_location=device, weights_only=False)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["opt"])
        gen.set_state(ckpt["gen"])
        step, log = ckpt["step"], ckpt["log"]
        print(f"{name}: resuming at step {step}")
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{name}: {type(model).__name__}, {n_params / 1e6:.2f}M parameters, {len(train_tokens)} "
          f"training bytes, device {device}")
    model.train()
    bar = tqdm(total=args.steps, initial=step, desc=name, dynamic_ncols=True)
    start = time.perf_counter()
    while step < args.steps:
        starts = torch.randint(0, len(train_tokens) - args.seq_len - 1, (args.batch_size,), generator=gen)
        batch = torch.from_numpy(np.stack([train_tokens[s:s + args.seq_len + 1] for s in starts.tolist()]))
        batch = batch.to(device)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        logits = model(input_ids=batch[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                 batch[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        row = {"step": step, "train_bpb": loss.item() / math.log(2), "heldout_bpb": ""}
        if step % args.eval_every == 0 or step == args.steps:
            row["heldout_bpb"] = bits_per_byte(model, heldout, args.seq_len, device, max_windows=16)
        log.append(row)
        bar.set_postfix(bpb=f"{row['train_bpb']:.3f}", heldout=row["heldout_bpb"] and f"{row['heldout_bpb']:.3f}")
        bar.update(1)
        if step % args.save_every == 0 or step == args.steps:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "gen": gen.get_state(),
                        "step": step, "log": log}, ckpt_path)
    bar.close()
    elapsed = time.perf_counter() - start
    write_artifact(name, model, corpus, log, args, elapsed, device)


def write_artifact(name, model, corpus, log, args, elapsed, device) -> None:
    out = OUT_ROOT / name
    out.mkdir(parents=True, exist_ok=True)
    model = model.to("cpu", torch.float32)
    model.config.dtype = torch.float32
    model.save_pretrained(str(out), safe_serialization=True)
    for extra in ("generation_config.json",):           # HF writes it; eos lives in config.json
        (out / extra).unlink(missing_ok=True)
    with open(out / "loss.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["step", "train_bpb", "heldout_bpb"])
        w.writeheader()
        w.writerows(log)
    heldout = {k: bits_per_byte(model, corpus[k].tokens(), args.seq_len, torch.device("cpu"))
               for k in ("heldout_topics", "heldout_docstrings")}
    info = {"model": name, "architecture": type(model).__name__,
            "parameters": sum(p.numel() for p in model.parameters()),
            "training": {k: getattr(args, k) for k in ("steps", "batch_size", "seq_len", "lr", "warmup", "seed")}
            | {"seconds": round(elapsed), "device": str(device), "torch": torch.__version__},
            "heldout_bits_per_byte_hf": heldout, "corpus": describe(corpus)}
    (out / "training.json").write_text(json.dumps(info, indent=1) + "\n")
    plot_loss(log, out / "loss.png", name)
    print(f"{name}: wrote {out} (held-out bits per byte: {heldout})")


def plot_loss(log: list[dict], path: Path, name: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5, 3), dpi=100)
    steps = [r["step"] for r in log]
    ax.plot(steps, [r["train_bpb"] for r in log], lw=0.6, alpha=0.6, label="train batch")
    ev = [(r["step"], r["heldout_bpb"]) for r in log if r["heldout_bpb"] != ""]
    if ev:
        ax.plot(*zip(*ev), "o-", ms=3, label="held-out topics")
    ax.set_xlabel("step")
    ax.set_ylabel("bits per byte")
    ax.set_ylim(0, 8.5)
    ax.set_title(name)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", choices=[*CONFIGS, "all"], default="all")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--work-dir", default=str(REPO / ".train"), help="resume checkpoints (not shipped)")
    p.add_argument("--cpu", action="store_true", help="train on CPU even when CUDA is present")
    args = p.parse_args()
    for name in (CONFIGS if args.model == "all" else [args.model]):
        train(name, args)


if __name__ == "__main__":
    main()
