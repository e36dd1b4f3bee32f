"""The PyTorch + transformers peer of `sluice bench engine --device cuda`.

Builds a Llama of the same synthetic shape (random BF16 weights, on the GPU),
then measures greedy decode steps at each batch after a prefill of `context`
tokens per sequence, and whole-prompt prefill, the way sluice's bench does:
wall-clock per step, median. Eager mode, SDPA attention, DynamicCache
(transformers' defaults). Prints JSON lines, the last one a summary.
"""

import argparse
import json
import statistics
import time

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

SHAPES = {
    "llama-3.1-8b": dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=14336,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=128),
    "llama-3.2-1b": dict(num_hidden_layers=16, hidden_size=2048, intermediate_size=8192,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64),
}


def timed(fn):
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prompts", default="1024,8192")
    a = ap.parse_args()
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    config = LlamaConfig(**SHAPES[a.shape], vocab_size=128256, max_position_embeddings=131072,
                         rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    with torch.device("cuda"):
        model = LlamaForCausalLM(config).eval()
    summary = {"engine": "pytorch+transformers", "torch": torch.__version__,
               "transformers": transformers.__version__, "shape": a.shape}
    with torch.no_grad():
        for batch in [int(b) for b in a.batches.split(",") if b]:
            ids = torch.randint(0, config.vocab_size, (batch, a.context), device="cuda")
            out = model(ids, use_cache=True, logits_to_keep=1)
            cache = out.past_key_values
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            times = []
            for step in range(a.steps + 3):
                out, dt = timed(lambda: model(nxt, past_key_values=cache, use_cache=True, logits_to_keep=1))
                nxt = out.logits[:, -1].argmax(-1, keepdim=True)
                if step >= 3:
                    times.append(dt)
            step_s = statistics.median(times)
            line = {"bench": "decode", "engine": "pytorch+transformers", "batch": batch,
                    "context": a.context, "step_ms_median": step_s * 1e3, "tokens_per_s": batch / step_s}
            print(json.dumps(line), flush=True)
            summary[f"decode_tok_s_b{batch}"] = batch / step_s
            del cache, out
            torch.cuda.empty_cache()
        for prompt in [int(p) for p in a.prompts.split(",") if p]:
            ids = torch.randint(0, config.vocab_size, (1, prompt), device="cuda")
            times = []
            for i in range(4):
                _, dt = timed(lambda: model(ids, use_cache=True, logits_to_keep=1))
                if i > 0:
                    times.append(dt)
            s = statistics.median(times)
            print(json.dumps({"bench": "prefill", "engine": "pytorch+transformers", "prompt": prompt,
                              "ms_median": s * 1e3, "tokens_per_s": prompt / s}), flush=True)
            summary[f"prefill_tok_s_{prompt}"] = prompt / s
    summary["summary"] = True
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
