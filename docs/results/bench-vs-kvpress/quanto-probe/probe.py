"""Bounded probe: one prefill + 3 decode steps of a tiny llama on transformers' quanto QuantizedCache."""
import time, torch
from transformers import QuantizedCache
from tests.conftest import make_tiny
t0 = time.perf_counter()
model = make_tiny("llama")
cache = QuantizedCache("quanto", model.config, nbits=4, q_group_size=8, residual_length=4)
ids = torch.randint(0, 100, (1, 40))
with torch.no_grad():
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    print("prefill done", round(time.perf_counter() - t0, 1), "s", flush=True)
    tok = out.logits[:, -1:].argmax(-1)
    for _ in range(6):
        out = model(input_ids=tok, past_key_values=cache, use_cache=True)
        tok = out.logits[:, -1:].argmax(-1)
print("decode done", round(time.perf_counter() - t0, 1), "s", type(cache.layers[0]._quantized_keys))
