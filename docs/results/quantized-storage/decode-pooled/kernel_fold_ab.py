"""Old (286176c) vs new (bee23c8) quantized decode kernel, interleaved in one process, on one
layer of the default model's shapes (3 KV heads, 3 query rows each, d 64, group 64, residual 24)."""
import importlib.util, json, statistics, sys, time, torch
torch.set_num_threads(1)
from criticalkv.cache import quantized_attention as new
from criticalkv.cache.quantized_plan import plan
from criticalkv.cache.quantized_prefix import build_quantized_prefix
spec = importlib.util.spec_from_file_location("old_qa", "/tmp/qs2/aftersrc/src/criticalkv/cache/quantized_attention.py")
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
out = []
for mult in (1, 4):
    lengths = [310 * mult, 180 * mult, 125 * mult]
    t = max(lengths); g = torch.Generator().manual_seed(0)
    for bits in (8, 4):
        keys, values = torch.randn(1, 3, t, 64, generator=g), torch.randn(1, 3, t, 64, generator=g)
        keep = torch.zeros(1, 3, t, dtype=torch.bool)
        for h, n in enumerate(lengths): keep[0, h, :n] = True
        prefix = build_quantized_prefix(keys, values, keep, bits, 64)
        pool = prefix.decode_pool(); p = plan(prefix, pool, 64, 0, 32)
        q = torch.randn(3, 3, 64, generator=g); rk, rv = torch.randn(3, 24, 64), torch.randn(3, 24, 64)
        args = (q, pool, p, None, rk, rv, None, 0.125, bits, 64)
        assert torch.allclose(old.quantized_attention(*args), new.quantized_attention(*args), atol=1e-5)
        rounds = {"old": [], "new": []}
        for _ in range(15):
            for name, mod in (("old", old), ("new", new)):
                a = time.thread_time()
                for _ in range(50): mod.quantized_attention(*args)
                rounds[name].append(1e6 * (time.thread_time() - a) / 50)
        ratio = [n / o for n, o in zip(rounds["new"], rounds["old"])]
        rec = {"entries": sum(lengths), "bits": bits, "old_us_best": round(min(rounds["old"]), 1), "new_us_best": round(min(rounds["new"]), 1),
               "old_us_median": round(statistics.median(rounds["old"]), 1), "new_us_median": round(statistics.median(rounds["new"]), 1),
               "new_over_old_median": round(statistics.median(ratio), 3), "new_over_old_best": round(min(ratio), 3)}
        print(json.dumps(rec)); sys.stdout.flush()
