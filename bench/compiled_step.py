"""Sizing a compiled CPU step: a model's forward over N rows and a fixed KV buffer of T slots (static shapes, dense
boolean mask, K/V written by index as the static step does), eager with unmask's packed and fused linears against
torch.compile (inductor with freezing, which packs the linears itself), bfloat16, 2 threads; median of 5 loops of
100 calls after warm-up. Not the engine's path (it runs ragged batches eagerly on the CPU): a harness that says
what capturing a CPU step could save before anyone builds it.

    .venv/bin/python bench/compiled_step.py bench/models/unmask-tiny-5m-drafter 12
"""
import sys, time, statistics, torch, torch.nn.functional as F
from pathlib import Path
from unmask.models.loader import load_model
torch.set_num_threads(2)
N, T = int(sys.argv[2]) if len(sys.argv) > 2 else 12, int(sys.argv[3]) if len(sys.argv) > 3 else 512
model, spec = load_model(Path(sys.argv[1]), dtype="bfloat16", packed_linears=False)
packed, _ = load_model(Path(sys.argv[1]), dtype="bfloat16")
cfg = model.cfg
rope = model.rope
def rope_apply(x, cos, sin):  # the out= form cannot be traced; the same formula as one expression
    r, half = rope.rotary_dim, rope.rotary_dim // 2
    c, s_ = cos[..., None, :], sin[..., None, :]
    x1, x2 = x[..., :half].float(), x[..., half:r].float()
    out = torch.cat([x1 * c - x2 * s_, x2 * c + x1 * s_], dim=-1).to(x.dtype)
    return out if r == x.shape[-1] else torch.cat([out, x[..., r:]], dim=-1)
rope.apply = rope_apply
class Ctx:
    sync_free = True   # rotary angles computed, not read from the table (no host read in a graph)
    def __init__(self, kc, vc, slots, mask):
        self.kc, self.vc, self.slots, self.mask = kc, vc, slots, mask
    def attend(self, q, k, v, layer):
        self.kc[layer].index_copy_(1, self.slots, k.transpose(0, 1))
        self.vc[layer].index_copy_(1, self.slots, v.transpose(0, 1))
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], self.kc[layer][None], self.vc[layer][None],
                                             attn_mask=self.mask, enable_gqa=True)[0]
        return out.transpose(0, 1)
def make():
    kc = torch.randn(cfg.num_layers, cfg.num_kv_heads, T, cfg.head_dim).bfloat16()
    vc = torch.randn(cfg.num_layers, cfg.num_kv_heads, T, cfg.head_dim).bfloat16()
    pos = torch.arange(300, 300 + N); slots = pos.clone()
    mask = torch.arange(T)[None, :] <= pos[:, None]
    ids = torch.randint(4, 8000, (N,))
    return ids, pos, kc, vc, slots, mask
def step(m, ids, pos, kc, vc, slots, mask):
    h = m._run(ids, pos, Ctx(kc, vc, slots, mask))
    return m.logits(h)
args = make()
with torch.no_grad():
    ref = step(packed, *args)
    eager = lambda: step(packed, *args)
    import torch._inductor.config as ic
    ic.freezing = True
    t0 = time.perf_counter()
    comp = torch.compile(lambda *a: step(model, *a), dynamic=False)
    out = comp(*args); print(f"compile {time.perf_counter() - t0:.1f} s; max |diff| {(out - ref).abs().max().item():.3f} (logit scale {ref.abs().max().item():.1f})")
    compiled = lambda: comp(*args)
    def per(f, n=100):
        for _ in range(10): f()
        t = time.perf_counter()
        for _ in range(n): f()
        return (time.perf_counter() - t) / n * 1e3
    r = {"eager": [], "compiled": []}
    for _ in range(5):
        r["eager"].append(per(eager)); r["compiled"].append(per(compiled))
    e, c = statistics.median(r["eager"]), statistics.median(r["compiled"])
    print(f"N={N} T={T}: eager (packed+fused) {e:.2f} ms, compiled {c:.2f} ms, x{e / c:.2f}")
