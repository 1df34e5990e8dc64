"""The reference side of tandem's GPU benchmark: the same model shapes (SmolLM2-135M and
Llama-3.1-8B, random bf16 weights) through PyTorch/transformers on the same GPU: prefill of a
2048-token prompt and decode time per step at batch 1, 32 and 128 with a 512-token context.
Prints one JSON line."""
import json
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

SHAPES = {
    "SmolLM2-135M": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, rope_theta=100000.0,
                         max_position_embeddings=8192, tie_word_embeddings=True),
    "Llama-3.1-8B": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                         num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
                         max_position_embeddings=131072, tie_word_embeddings=False),
}


def timed(fn, repeat=3):
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


def main():
    out = {}
    for name, shape in SHAPES.items():
        cfg = LlamaConfig(**shape, torch_dtype=torch.bfloat16)
        with torch.device("cuda"):
            model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
        res = {}
        with torch.no_grad():
            ids = torch.randint(0, cfg.vocab_size, (1, 2048), device="cuda")
            s = timed(lambda: model(ids, use_cache=False))
            res["prefill_tok_s"] = 2048 / s
            for batch in (1, 32, 128):
                ctx = torch.randint(0, cfg.vocab_size, (batch, 512), device="cuda")
                past = model(ctx, use_cache=True).past_key_values
                nxt = torch.randint(0, cfg.vocab_size, (batch, 1), device="cuda")
                torch.cuda.synchronize()
                t = time.perf_counter()
                steps = 16
                for _ in range(steps):
                    o = model(nxt, past_key_values=past, use_cache=True)
                    past = o.past_key_values
                torch.cuda.synchronize()
                res[f"decode_b{batch}_ms"] = (time.perf_counter() - t) * 1e3 / steps
        out[name] = res
        del model
        torch.cuda.empty_cache()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
