"""Long context, as ratios measured in one run: a Llama-3-shaped decoder (head dim 128, grouped
key/value heads, random weights) at 8k/16k/32k tokens, plain eager attention vs mps_safe_eager (pieces of
samples and key/value heads, query-row blocks where one head crosses a limit) vs eager under
guard("chunk"). With --check-70k (the GPU acceptance run of issue 25): at 70,000 tokens one head's
scores are 4.9e9 elements > 2**32, and emulated eager is wrong while guard("chunk") and mps_safe_eager
equal the plain result.

Run: python benchmarks/long_context.py --device cpu --lengths 8192,16384 --reps 3
     python benchmarks/long_context.py --device cuda --lengths 8192,16384,32768 --reps 5
     python benchmarks/long_context.py --device cuda --check-70k
Each figure is the median of `reps` interleaved repetitions after one warm-up; ratios are to plain eager.
Peak memory is CUDA's max_memory_allocated per condition (not measured on the CPU).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time

import torch

import mpsimpact
from mpsimpact.attention import register


def build(device: str, dtype: torch.dtype, layers: int, heads: int, kv_heads: int, positions: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=1000, hidden_size=128 * heads, intermediate_size=512 * heads,
                         num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         max_position_embeddings=positions)
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device=device, dtype=dtype).eval()


def forward(model, ids, attention: str, context) -> tuple[torch.Tensor, float, float]:
    """Last-layer logits, seconds and peak GiB (CUDA) of one forward under `attention` and `context`."""
    model.config._attn_implementation = attention
    sync = torch.cuda.synchronize if ids.is_cuda else (lambda: None)
    if ids.is_cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    sync()
    start = time.perf_counter()
    with torch.inference_mode(), context():
        logits = model(ids, logits_to_keep=0).logits
    sync()
    peak = torch.cuda.max_memory_allocated() / 2**30 if ids.is_cuda else float("nan")
    return logits, time.perf_counter() - start, peak


CONDITIONS = {
    "eager": ("eager", contextlib.nullcontext),
    "mps_safe_eager": ("mps_safe_eager", contextlib.nullcontext),
    "eager+guard chunk": ("eager", lambda: mpsimpact.guard("chunk", devices=("cpu", "cuda"))),
}


def ratios(args) -> dict:
    register()
    results = {}
    for length in map(int, args.lengths.split(",")):
        model = build(args.device, getattr(torch, args.dtype), 1, args.heads, args.kv_heads, length)
        ids = torch.randint(0, 1000, (1, length), device=args.device)
        times = {name: [] for name in CONDITIONS}
        peaks, outputs = {}, {}
        for rep in range(args.reps + 1):
            names = list(CONDITIONS)[rep % len(CONDITIONS):] + list(CONDITIONS)[:rep % len(CONDITIONS)]
            for name in names:
                logits, seconds, peak = forward(model, ids, *CONDITIONS[name])
                if rep:  # the first round warms up
                    times[name].append(seconds)
                peaks[name], outputs[name] = peak, logits[0, -1].float().cpu()
        base = statistics.median(times["eager"])
        results[length] = {
            name: {"median_s": round(statistics.median(t), 4), "ratio": round(statistics.median(t) / base, 3),
                   "peak_gib": round(peaks[name], 2),
                   "max_abs_diff_vs_eager": float((outputs[name] - outputs["eager"]).abs().max())}
            for name, t in times.items()
        }
        print(length, json.dumps(results[length]), flush=True)
        del model
    return results


def check_70k(args) -> dict:
    """Emulated eager is wrong; guard chunk and mps_safe_eager equal plain eager (all on the device)."""
    register()
    length, bits = args.length, args.index_bits
    model = build(args.device, torch.bfloat16, 2, 2, 1, length)
    ids = torch.randint(0, 1000, (1, length), device=args.device)
    found = {}
    plain, seconds, peak = forward(model, ids, "sdpa", contextlib.nullcontext)  # memory-light reference
    found["plain sdpa"] = {"s": seconds, "peak_gib": peak}
    plain = plain.float()
    variants = {
        "plain eager": ("eager", contextlib.nullcontext),
        "emulated eager": ("eager", lambda: mpsimpact.emulate(index_bits=bits)),
        "emulated eager + guard chunk": ("eager", lambda: _both(mpsimpact.emulate(index_bits=bits),
                                                                mpsimpact.guard("chunk", index_bits=bits))),
        "emulated mps_safe_eager": ("mps_safe_eager", lambda: mpsimpact.emulate(index_bits=bits)),
    }
    for name, (attention, context) in variants.items():
        try:
            logits, seconds, peak = forward(model, ids, attention, context)
        except (RuntimeError, mpsimpact.MpsImpactError) as error:
            found[name] = {"error": str(error).splitlines()[0][:300]}
            continue
        diff = (logits.float() - plain).abs().amax(dim=-1)[0]  # per position
        found[name] = {"s": round(seconds, 2), "peak_gib": round(peak, 2), "max_abs_diff": float(diff.max()),
                       "positions_off_by_more_than_0.05": int((diff > 0.05).sum())}
        print(name, json.dumps(found[name]), flush=True)
        del logits
    return found


@contextlib.contextmanager
def _both(first, second):
    with first, second:
        yield


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--lengths", default="8192,16384")
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--kv-heads", type=int, default=1)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--check-70k", action="store_true")
    parser.add_argument("--length", type=int, default=70_000, help="With --check-70k (smaller for a dry run).")
    parser.add_argument("--index-bits", type=int, default=32, help="With --check-70k (20 for a dry run at 1536).")
    parser.add_argument("--json", default=None, help="Also write the results here.")
    args = parser.parse_args()
    results = check_70k(args) if args.check_70k else ratios(args)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(results, fh, indent=2)


if __name__ == "__main__":
    main()
