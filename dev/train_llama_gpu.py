"""Trains a small Llama-style model (transformers' LlamaForCausalLM from a config) with
attnkern's attention and with torch's SDPA, from the same seed, on the same token
stream, and once more with SDPA from another seed: the attnkern-SDPA gap in the loss
curves against the spread that the seed alone gives. Writes losses.json (every
step's loss, step times, tokens/s, the gaps) and losses.png to --out.

    python3 dev/train_llama_gpu.py --out train-gpu              # the device run: 200 steps, bf16 autocast
    python3 dev/train_llama_gpu.py --smoke --out /tmp/train     # CPU, float32, a tiny model, 2 steps

The model: 4 layers, d_model 512, 8 query heads over 2 k/v heads (grouped-query
attention), SwiGLU width 1376, vocabulary 4096, sequences of 1024, batch 8; AdamW
(lr 3e-4 after 20 warm-up steps, betas 0.9/0.95, weight decay 0.1), gradients clipped
at 1.0, bf16 autocast on CUDA. The token stream is a fixed random Markov chain (each
token followed by one of 4 successors 90% of the time, else by any token), drawn from
--data-seed: learnable, so the loss falls from log(4096) = 8.3 towards the chain's
entropy (about 2.4 nats), and identical for every run. attnkern's attention is
attnkern.integrations.transformers.register(kernel=--kernel): under bf16 autocast the
q, k, v it gets are bfloat16, and kernel="auto" picks a kernel with a bfloat16 backward.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import numpy as np

SUCCESSORS, FOLLOW = 4, 0.9


def token_stream(seed: int, sequences: int, length: int, vocab: int) -> np.ndarray:
    """(sequences, length + 1) int64 tokens of a random Markov chain drawn from seed."""
    rng = np.random.default_rng(seed)
    successors = rng.integers(0, vocab, (vocab, SUCCESSORS))
    tokens = np.empty((sequences, length + 1), np.int64)
    tokens[:, 0] = rng.integers(0, vocab, sequences)
    for t in range(length):
        follow = rng.random(sequences) < FOLLOW
        nxt = successors[tokens[:, t], rng.integers(0, SUCCESSORS, sequences)]
        tokens[:, t + 1] = np.where(follow, nxt, rng.integers(0, vocab, sequences))
    return tokens


def chain_entropy(vocab: int) -> float:
    """The stream's entropy per token in nats (successors drawn with repeats ignored):
    the loss a perfect model approaches."""
    p_follow = FOLLOW / SUCCESSORS + (1 - FOLLOW) / vocab
    p_other = (1 - FOLLOW) / vocab
    return -(SUCCESSORS * p_follow * math.log(p_follow) + (vocab - SUCCESSORS) * p_other * math.log(p_other))


def settings(args) -> dict:
    if args.smoke:
        return {"layers": 2, "d_model": 64, "heads": 4, "kv_heads": 2, "ffn": 176, "vocab": 128, "seq": 32,
                "batch": 2, "steps": args.steps or 2, "warmup_steps": 1, "lr": 1e-3}
    return {"layers": 4, "d_model": 512, "heads": 8, "kv_heads": 2, "ffn": 1376, "vocab": 4096, "seq": args.seq,
            "batch": args.batch, "steps": args.steps or 200, "warmup_steps": 20, "lr": 3e-4}


def train(cfg: dict, attention: str, model_seed: int, tokens: np.ndarray, device, autocast_dtype,
          profile: int = 0) -> dict:
    """One run: losses per step, step times (the device waited for), tokens/s after warm-up."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=cfg["vocab"], hidden_size=cfg["d_model"], intermediate_size=cfg["ffn"],
                         num_hidden_layers=cfg["layers"], num_attention_heads=cfg["heads"],
                         num_key_value_heads=cfg["kv_heads"], max_position_embeddings=cfg["seq"],
                         tie_word_embeddings=False)
    torch.manual_seed(model_seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention).to(device)
    model.train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg["lr"], betas=(0.9, 0.95), fused=device.type == "cuda")
    warm = cfg["warmup_steps"]
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm))
    losses, step_ms = [], []
    b = cfg["batch"]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for step in range(cfg["steps"]):
        batch = torch.from_numpy(tokens[step * b:(step + 1) * b]).to(device)
        sync()
        start = time.perf_counter()
        with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            loss = _loss(model, batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        sync()
        step_ms.append((time.perf_counter() - start) * 1e3)
        losses.append(float(loss.detach()))
        if not math.isfinite(losses[-1]):
            raise SystemExit(f"{attention} seed {model_seed}: loss {losses[-1]} at step {step}")
    if profile:  # a few more steps under torch.profiler: where the step's host and device time goes
        from torch.profiler import ProfilerActivity
        from torch.profiler import profile as torch_profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with torch_profile(activities=acts) as prof:
            for step in range(profile):
                batch = torch.from_numpy(tokens[step * b:(step + 1) * b]).to(device)
                with torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
                    loss = _loss(model, batch)
                loss.backward()
                opt.zero_grad(set_to_none=True)
            sync()
        print(f"# profile of {attention}, {profile} forward + backward steps", flush=True)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25), flush=True)
        if device.type == "cuda":
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=15), flush=True)
    timed = step_ms[min(warm, len(step_ms) - 1):]
    tokens_per_s = b * cfg["seq"] / (np.median(timed) / 1e3)
    return {"attention": attention, "model_seed": model_seed, "losses": losses, "step_ms": step_ms,
            "tokens_per_s": float(tokens_per_s), "median_step_ms": float(np.median(timed))}


def _loss(model, batch):
    """Next-token cross-entropy of one batch (batch: (B, seq + 1) tokens), in float32."""
    import torch

    logits = model(input_ids=batch[:, :-1]).logits
    return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())


def gaps(runs: dict, tail: int) -> dict:
    """max and mean |loss difference| over all steps and over the last `tail`: attnkern
    against SDPA (same seed), and SDPA against SDPA from another seed (the noise)."""
    a, s, s2 = (np.array(runs[k]["losses"]) for k in ("attnkern", "sdpa", "sdpa_other_seed"))
    out = {}
    for name, x, y in (("attnkern_vs_sdpa", a, s), ("sdpa_vs_other_seed", s, s2)):
        d = np.abs(x - y)
        out[name] = {"max": float(d.max()), "mean": float(d.mean()), "max_last": float(d[-tail:].max()),
                     "mean_last": float(d[-tail:].mean())}
    return out


def plot(runs: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.5))
    for key, style in (("attnkern", "-"), ("sdpa", "--"), ("sdpa_other_seed", ":")):
        r = runs[key]
        ax.plot(r["losses"], style, label=f"{key} (seed {r['model_seed']}, {r['tokens_per_s']:.0f} tok/s)")
    ax.set(xlabel="step", ylabel="loss (nats)", title="training loss")
    ax.legend(fontsize=8)
    a, s, s2 = (np.array(runs[k]["losses"]) for k in ("attnkern", "sdpa", "sdpa_other_seed"))
    bx.plot(np.abs(a - s), label="|attnkern - sdpa| (same seed)")
    bx.plot(np.abs(s - s2), label="|sdpa - sdpa, other seed| (noise)")
    bx.set(xlabel="step", ylabel="|loss difference|", title="gap against the seed's spread", yscale="log")
    bx.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", required=True, help="directory for losses.json and losses.png")
    p.add_argument("--steps", type=int, help="optimizer steps (default 200; --smoke 2)")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seed", type=int, default=0, help="the model seed of the attnkern and SDPA runs")
    p.add_argument("--other-seed", type=int, default=1, help="the model seed of the second SDPA run")
    p.add_argument("--data-seed", type=int, default=1234)
    p.add_argument("--kernel", default="auto", help="attnkern's kernel (default auto)")
    p.add_argument("--smoke", action="store_true", help="CPU, float32, a tiny model, 2 steps: checks the script")
    p.add_argument("--profile", type=int, default=0, metavar="STEPS",
                   help="after each run (attnkern, sdpa), profile STEPS more forward + backward steps (torch.profiler) "
                        "and print the ops by host and device time")
    p.add_argument("--replot", metavar="JSON", help="only draw losses.png into --out from a run's losses.json")
    args = p.parse_args(argv)
    if args.replot:
        with open(args.replot) as f:
            result = json.load(f)
        os.makedirs(args.out, exist_ok=True)
        plot(result["runs"], os.path.join(args.out, "losses.png"), result["title"])
        return 0
    import torch

    import attnkern
    import attnkern.integrations.transformers as ak

    cfg = settings(args)
    if args.smoke:
        device, autocast_dtype = torch.device("cpu"), None
    else:
        if not torch.cuda.is_available():
            raise SystemExit("train_llama_gpu.py needs a CUDA GPU (or --smoke)")
        device, autocast_dtype = torch.device("cuda"), torch.bfloat16
    name = ak.register(kernel=args.kernel)
    tokens = token_stream(args.data_seed, cfg["steps"] * cfg["batch"], cfg["seq"], cfg["vocab"])
    runs = {}
    for key, attention, seed in (("attnkern", name, args.seed), ("sdpa", "sdpa", args.seed),
                                 ("sdpa_other_seed", "sdpa", args.other_seed)):
        print(f"# {key}: {attention}, model seed {seed}, {cfg['steps']} steps", file=sys.stderr, flush=True)
        runs[key] = train(cfg, attention, seed, tokens, device, autocast_dtype,
                          args.profile if key != "sdpa_other_seed" else 0)
        r = runs[key]
        print(f"{key:<16} first loss {r['losses'][0]:.4f} last {r['losses'][-1]:.4f} "
              f"median step {r['median_step_ms']:.1f} ms, {r['tokens_per_s']:.0f} tokens/s", flush=True)
    where = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    title = (f"Llama {cfg['layers']} layers, d_model {cfg['d_model']}, GQA {cfg['heads']}/{cfg['kv_heads']}, "
             f"seq {cfg['seq']}, batch {cfg['batch']}, {'bf16 autocast' if autocast_dtype else 'float32'}, "
             f"{where}, attnkern kernel={args.kernel}")
    result = {"title": title, "settings": cfg, "device": where, "torch": torch.__version__,
              "attnkern": attnkern.__version__, "chain_entropy": chain_entropy(cfg["vocab"]),
              "gaps": gaps(runs, tail=min(50, cfg["steps"])), "runs": runs}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "losses.json"), "w") as f:
        json.dump(result, f, indent=1)
    try:
        plot(runs, os.path.join(args.out, "losses.png"), title)
    except ImportError:  # the GPU host's Python may lack matplotlib: draw it elsewhere with --replot
        print(f"# no matplotlib here: python3 dev/train_llama_gpu.py --replot {args.out}/losses.json --out DIR")
    g = result["gaps"]
    ours = g["attnkern_vs_sdpa"]
    print(f"# |attnkern - sdpa| max {ours['max']:.4f} (last steps {ours['max_last']:.4f}); "
          f"seed spread |sdpa - sdpa'| max {g['sdpa_vs_other_seed']['max']:.4f} "
          f"(last steps {g['sdpa_vs_other_seed']['max_last']:.4f}); chain entropy {result['chain_entropy']:.3f}")
    print(f"# wrote {args.out}/losses.json, {args.out}/losses.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
