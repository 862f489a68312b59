"""DiffusionGemma (google/diffusiongemma-*): the text path of `DiffusionGemmaForBlockDiffusion`, natively.

One set of Gemma-4 weights runs in two modes (transformers.models.diffusion_gemma, modeling file):
  * encoder: causal over the prompt (or the last accepted canvas); writes the KV cache;
  * decoder: the canvas, bidirectional over [cached prefix ; canvas], never writes the cache; its input
    embeddings are self-conditioned on the previous denoising step's (temperature-scaled) logits.
Both modes share every text weight; only the per-layer `layer_scalar` buffers exist once per mode.

A segment of the ragged batch may hold both: its first `Segment.extra["encoder"]` tokens are encoder
tokens (causal, written to the cache) and the rest is a decoder canvas that sees them. So accepting a
canvas (encoder pass) and the first denoising step of the next canvas share one forward.

Layer (Gemma 4 "sandwich" norms, dense GeGLU MLP in parallel with a routed MoE):
    h = x + post_attn_norm(attn(input_norm(x)))
    y = h + post_ff_norm(post_ff_norm_1(mlp(pre_ff_norm(h))) + post_ff_norm_2(moe(pre_ff_norm_2(h), route(h))))
    out = y * layer_scalar
Attention: q/k RMS-normed (weighted), v RMS-normed (unweighted), scale 1.0; full-attention layers have
their own head_dim / kv heads and no v_proj (values are the raw k_proj output). Sliding layers: the encoder
sees keys in (p - W, p]; the decoder sees the last W - 1 cached tokens (what transformers'
DynamicSlidingWindowLayer keeps) plus the whole canvas.
The vision tower is never built: image inputs are refused by the request path (gemma_sequence.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from unmask.errors import InvalidRequestError
from unmask.models.attention import (AttentionBatch, Segment, attend_prefix_causal, can_split_on, repeat_kv,
                                     sdpa)
from unmask.models.diffusion_gemma_cache import GemmaKVCache
from unmask.models.diffusion_gemma_checkpoint import (FULL, SLIDING, GemmaArch, from_canonical_names,
                                                      parse_diffusion_gemma, to_canonical_names)
from unmask.models.diffusion_gemma_ffn import Experts, GeGLU, Router
from unmask.models.diffusion_gemma_ops import (GemmaRMSNorm, cast_like, fuse_rows, inv_freq, normalized,
                                               rms_unweighted, rotate, to_f32)
from unmask.models.layers import activation
from unmask.models.registry import Family, register


# Below this many score elements a CPU step is dominated by per-op overhead, where three plain ops beat SDPA's
# kernel setup (2.5x faster measured on [4 heads, 8 x 48]; bitwise the same there).
SMALL_ATTENTION = 1 << 16


def attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None) -> Tensor:
    """q [H, Lq, D], k/v [Hkv, Lk, D] -> [H, Lq, D]; scale 1.0 (Gemma 4 normalises q and k instead)."""
    h, lq, d = q.shape
    hk, lk = k.shape[0], k.shape[1]
    if q.device.type != "cpu" or q.dtype != torch.float32 or h * lq * lk > SMALL_ATTENTION:
        return sdpa(q, k, v, mask, 1.0)
    g = h // hk  # query heads per kv head, grouped as repeat_interleave orders them
    scores = torch.matmul(q.reshape(hk, g * lq, d), k.transpose(1, 2))
    if mask is not None:
        scores = scores.masked_fill(~(mask.repeat(g, 1) if g > 1 else mask), float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1), v).view(h, lq, d)


# A segment with at least this many encoder tokens (a prompt's prefill, or a chunk of it) skips the dense
# mask: full layers run causal SDPA (no mask, upper triangle skipped; a later chunk on CPU also reads the
# cached prefix unmasked, merged by log-sum-exp) and sliding layers attend in query chunks to the keys their
# window reaches, so prefill cost grows with n * W there instead of n^2.
LONG_ENCODER = 256
CAUSAL, BANDED, AFTER_PREFIX = "causal", "banded", "after_prefix"


@dataclass(frozen=True)
class LongEncoder:
    """In place of a dense mask: the segment's first `n_enc` rows are encoder rows of this `kind` (CAUSAL:
    from position 0 on a full layer; AFTER_PREFIX: a later chunk on a full layer, on CPU; BANDED: a sliding
    layer); the canvas rows after them see every key the layer keeps (sliding: the last W - 1 prefix
    positions and the canvas), which needs no mask either."""

    kind: str
    n_enc: int


def attend_causal(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """Causal attention where query i sits at key i (an encoder segment from position 0)."""
    g = q.shape[0] // k.shape[0]
    return F.scaled_dot_product_attention(q[None], repeat_kv(k, g)[None], repeat_kv(v, g)[None], is_causal=True,
                                          scale=1.0)[0]


def attend_banded(q: Tensor, k: Tensor, v: Tensor, q_start: int, k_start: int, window: int) -> Tensor:
    """Causal sliding-window attention (key p' visible from p iff p - W < p' <= p) computed per query chunk
    over only the keys its window reaches. q [H, n, D] at positions q_start.., k/v [Hkv, m, D] at k_start..
    (covering q_start - W + 1 .. q_start + n - 1)."""
    n = q.shape[1]
    chunk = max(window, 128)
    outs = []
    for a in range(0, n, chunk):
        b = min(a + chunk, n)
        lo = max(k_start, q_start + a - window + 1)  # first key any row of the chunk sees
        hi = q_start + b
        qpos = torch.arange(q_start + a, q_start + b, device=q.device)[:, None]
        kpos = torch.arange(lo, hi, device=q.device)[None, :]
        mask = (kpos <= qpos) & (kpos > qpos - window)
        outs.append(attend(q[:, a:b], k[:, lo - k_start:hi - k_start], v[:, lo - k_start:hi - k_start], mask))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)



class GemmaAttention(nn.Module):
    def __init__(self, a: GemmaArch, layer: int):
        super().__init__()
        self.layer = layer
        self.sliding = a.layer_types[layer] == SLIDING
        self.h, self.kv, self.d = a.num_heads, a.kv_heads[layer], a.head_dims[layer]
        bias = a.attention_bias
        self.q_proj = nn.Linear(a.hidden_size, self.h * self.d, bias=bias)
        self.k_proj = nn.Linear(a.hidden_size, self.kv * self.d, bias=bias)
        self.v_proj = nn.Linear(a.hidden_size, self.kv * self.d, bias=bias) if self.sliding else None
        self.o_proj = nn.Linear(self.h * self.d, a.hidden_size, bias=bias)
        self.q_norm = GemmaRMSNorm(self.d, a.rms_eps)
        self.k_norm = GemmaRMSNorm(self.d, a.rms_eps)
        self.eps = a.rms_eps
        self.window = a.sliding_window
        self._fused: tuple[Tensor, Tensor | None, Tensor] | None = None

    def _projections(self) -> tuple[Tensor, Tensor | None, Tensor]:
        """(fused q|k|v weight, fused bias, per-head norm weights [H + Hkv, D]) built on first use."""
        f = self._fused
        if f is None or f[0].data_ptr() != self.q_proj.weight.data_ptr():
            mods = [self.q_proj, self.k_proj] + ([self.v_proj] if self.v_proj is not None else [])
            w = fuse_rows(*mods)
            b = torch.cat([m.bias for m in mods]) if mods[0].bias is not None else None
            norm_w = torch.cat([self.q_norm.weight.float().expand(self.h, self.d),
                                self.k_norm.weight.float().expand(self.kv, self.d)])
            f = self._fused = (w, b, norm_w)
        return f

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx: "_Context") -> Tensor:
        n, h, kv, d = x.shape[0], self.h, self.kv, self.d
        w, b, norm_w = self._projections()
        heads = F.linear(x, w, b).view(n, -1, d)          # [q heads | k heads | v heads (sliding)]
        # q_norm / k_norm (weighted) and v_norm (unweighted) share one RMS pass; full layers take V from
        # the raw k_proj output, so their V is the unweighted normalisation of the K heads
        xn = normalized(heads, self.eps)
        qk = rotate(cast_like(xn[:, :h + kv] * norm_w, x), cos, sin)
        q, k = qk[:, :h], qk[:, h:]
        v = cast_like(xn[:, h + kv:] if self.v_proj is not None else xn[:, h:], x)
        q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [heads, N, D]
        if len(ctx.segments) == 1:
            out = self._segment(q, k, v, ctx.segments[0], *ctx.masks[self.sliding][0])
        else:
            out = q.new_empty(h, n, d)
            for seg, off, (lo, mask) in zip(ctx.segments, ctx.offsets, ctx.masks[self.sliding]):
                sl = slice(off, off + seg.length)
                out[:, sl] = self._segment(q[:, sl], k[:, sl], v[:, sl], seg, lo, mask)
        out = out.transpose(0, 1)
        return self.o_proj(out.reshape(n, h * d))

    def _segment(self, q: Tensor, k: Tensor, v: Tensor, seg: Segment, lo: int,
                 mask: "Tensor | LongEncoder | None") -> Tensor:
        cache = seg.cache
        if cache is not None:  # write in place (decoder tokens are scratch), attend to the cache view
            hi = seg.start + seg.length
            ck, cv = cache.k[self.layer], cache.v[self.layer]
            off = cache.first_position(self.layer)  # sliding layers keep a window (GemmaKVCache)
            ck[:, seg.start - off:hi - off] = k
            cv[:, seg.start - off:hi - off] = v
            k, v = ck[:, lo - off:hi - off], cv[:, lo - off:hi - off]
            if k.dtype != q.dtype:  # a cache kept in another dtype (--kv-cache-dtype)
                k, v = k.to(q.dtype), v.to(q.dtype)
        if isinstance(mask, LongEncoder):
            return self._long_encoder(q, k, v, seg.start, lo, mask)
        return attend(q, k, v, mask)

    def _long_encoder(self, q: Tensor, k: Tensor, v: Tensor, start: int, lo: int, how: LongEncoder) -> Tensor:
        """k/v are the keys [lo, start + q rows); see LongEncoder."""
        n = how.n_enc
        end = start + n - lo  # encoder keys are k[:, :end]
        if how.kind == CAUSAL:
            out = attend_causal(q[:, :n], k[:, :end], v[:, :end])
        elif how.kind == AFTER_PREFIX:
            out = attend_prefix_causal(q[:, :n], k[:, :end], v[:, :end], start, 1.0)
        else:
            out = attend_banded(q[:, :n], k[:, :end], v[:, :end], start, lo, self.window)
        if q.shape[1] == n:
            return out
        first = 0 if how.kind != BANDED else max(lo, start + n - self.window + 1) - lo
        return torch.cat([out, attend(q[:, n:], k[:, first:], v[:, first:], None)], dim=1)



class GemmaLayer(nn.Module):
    def __init__(self, a: GemmaArch, layer: int):
        super().__init__()
        d, eps = a.hidden_size, a.rms_eps
        self.eps = eps
        self.self_attn = GemmaAttention(a, layer)
        self.mlp = GeGLU(d, a.intermediate_size, a.act)
        self.router = Router(a)
        self.experts = Experts(a)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm", "post_feedforward_layernorm_1", "post_feedforward_layernorm_2",
                     "pre_feedforward_layernorm_2"):
            setattr(self, name, GemmaRMSNorm(d, eps))
        self.register_buffer("layer_scalar", torch.ones(1))          # decoder mode
        self.register_buffer("encoder_layer_scalar", torch.ones(1))  # encoder mode (stored separately)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, ctx: "_Context") -> Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, ctx))
        # the dense MLP's pre-norm, the experts' pre-norm and the router's unweighted norm all normalise x
        xn = normalized(x, self.eps)
        dense_in = cast_like(xn * to_f32(self.pre_feedforward_layernorm.weight), x)
        moe_in = cast_like(xn * to_f32(self.pre_feedforward_layernorm_2.weight), x)
        w, idx = self.router(cast_like(xn, x))
        dense = self.post_feedforward_layernorm_1(self.mlp(dense_in))
        moe = self.post_feedforward_layernorm_2(self.experts(moe_in, idx, w))
        x = x + self.post_feedforward_layernorm(dense + moe)
        if ctx.encoder_rows is None:  # decoder tokens only (the common denoising step)
            return x * self.layer_scalar
        if ctx.all_encoder:
            return x * self.encoder_layer_scalar
        return x * torch.where(ctx.encoder_rows[:, None], self.encoder_layer_scalar, self.layer_scalar)


class SelfConditioning(nn.Module):
    """post_norm(embeds + down(act(gate(pre_norm(s))) * up(pre_norm(s)))), s = softmax(prev logits) @ E * sqrt(H)."""

    def __init__(self, a: GemmaArch):
        super().__init__()
        self.pre_norm = GemmaRMSNorm(a.hidden_size, a.rms_eps)
        self.gate_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.up_proj = nn.Linear(a.hidden_size, a.intermediate_size, bias=False)
        self.down_proj = nn.Linear(a.intermediate_size, a.hidden_size, bias=False)
        self.act = activation(a.act)
        self.eps = a.rms_eps

    def forward(self, embeds: Tensor, soft: Tensor | None) -> Tensor:
        if soft is not None:  # soft = 0 (first step) adds exactly 0, so it is skipped
            h = self.pre_norm(soft)
            embeds = embeds + self.down_proj(self.act(self.gate_proj(h)) * self.up_proj(h))
        return rms_unweighted(embeds, self.eps)


class GemmaBackbone(nn.Module):
    def __init__(self, a: GemmaArch):
        super().__init__()
        self.embed_tokens = nn.Embedding(a.vocab_size, a.hidden_size)
        self.layers = nn.ModuleList(GemmaLayer(a, i) for i in range(a.num_layers))
        self.norm = GemmaRMSNorm(a.hidden_size, a.rms_eps)
        self.self_conditioning = SelfConditioning(a)


# ---------------------------------------------------------------------------------------- the model

@dataclass
class _Context:
    """Per-forward attention bookkeeping shared by all layers."""

    segments: list[Segment]
    offsets: list[int]
    masks: dict[bool, list[tuple[int, "Tensor | LongEncoder | None"]]]  # sliding? -> per segment (first key, mask)
    encoder_rows: Tensor | None                          # [N] bool, None when every token is a decoder token
    all_encoder: bool


def segment_masks(start: int, n_enc: int, n_dec: int, window: int | None, device: torch.device,
                  split_ok: bool = False) -> tuple[int, "Tensor | LongEncoder | None"]:
    """(first visible key, bool mask [n_enc + n_dec, keys], None, or a LongEncoder) for one segment and
    layer kind.

    Keys are the cache positions [lo, start + n_enc + n_dec). Encoder query p: causal, and within the window
    (k > p - W) on sliding layers. Decoder query: every canvas key, and the cached prefix [0, start + n_enc)
    (sliding layers: its last W - 1 positions, as transformers' sliding cache keeps them).
    """
    hi = start + n_enc + n_dec
    lo = 0 if window is None else max(0, start - window + 1)
    if n_enc == 0:
        return lo, None
    if n_enc >= LONG_ENCODER and (window is not None or start == 0 or split_ok):  # long prefill: no dense mask
        return lo, LongEncoder(BANDED if window is not None else CAUSAL if start == 0 else AFTER_PREFIX, n_enc)
    q = torch.arange(start, hi, device=device)[:, None]
    k = torch.arange(lo, hi, device=device)[None, :]
    enc = k <= q
    prefix_end = start + n_enc
    dec = torch.ones_like(enc)
    if window is not None:
        enc = enc & (k > q - window)
        dec = (k >= prefix_end) | (k > prefix_end - window)
    mask = torch.where(q < prefix_end, enc, dec)
    return lo, (None if bool(mask.all()) else mask)


class DiffusionGemmaLM(nn.Module):
    """Token ids + absolute positions over a ragged batch -> hidden states; `logits` adds the soft-cap."""

    keep_logits_on_device = True  # the sampler runs where the logits are (runner.py)
    # a canvas-only step (no encoder rows) has no host syncs or host-built tensors: CUDA graphs may replay it
    graph_decode_steps = True

    def __init__(self, a: GemmaArch):
        super().__init__()
        self.cfg = a
        self.model = GemmaBackbone(a)
        self.lm_head = nn.Linear(a.hidden_size, a.vocab_size, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight  # tied (lm_head = decoder embedding)
        first = {t: a.layer_types.index(t) for t in set(a.layer_types)}
        self.inv_freq = {t: inv_freq(*a.rope[t][:1], a.head_dims[first[t]], *a.rope[t][1:]) for t in first}

    # ------------------------------------------------------------------ helpers
    def _embed_scale(self, dtype: torch.dtype) -> Tensor:
        # a float32 scalar cast to the weight dtype (bf16 rounds sqrt(H), as the reference's buffer does)
        return torch.tensor(self.cfg.hidden_size ** 0.5, dtype=torch.float32).to(dtype)

    def _cos_sin(self, positions: Tensor, dtype: torch.dtype) -> dict[str, tuple[Tensor, Tensor]]:
        out = {}
        for t, f in self.inv_freq.items():
            if f.device != positions.device:
                f = self.inv_freq[t] = f.to(positions.device)
            freqs = positions.float()[:, None] * f
            emb = torch.cat([freqs, freqs], dim=-1)
            out[t] = (emb.cos().to(dtype), emb.sin().to(dtype))
        return out

    def soft_embeddings(self, logits: Tensor) -> Tensor:
        w = self.model.embed_tokens.weight
        probs = logits.to(w.dtype).softmax(dim=-1, dtype=torch.float32).to(w.dtype)
        return torch.matmul(probs, w) * self._embed_scale(w.dtype)

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids: Tensor, positions: Tensor, batch: AttentionBatch) -> Tensor:
        """input_ids/positions [N] flat over the segments -> final-normed hidden states [N, H].

        Segment.extra: {"encoder": leading encoder tokens (default: all), "sc_logits": [n_dec, V] or None}.
        """
        dev = input_ids.device
        w = self.model.embed_tokens.weight
        x = self.model.embed_tokens(input_ids) * self._embed_scale(w.dtype)
        split_ok = can_split_on(x)  # full layers of a later prefill chunk: prefix and own keys apart (CPU)
        offsets, off = [], 0
        enc_spans: list[tuple[int, int]] = []
        masks: dict[bool, list] = {True: [], False: []}
        plain_rows, soft_rows, soft = [], [], []
        for seg in batch.segments:
            extra = seg.extra or {}
            n_enc = int(extra.get("encoder", seg.length))
            n_dec = seg.length - n_enc
            offsets.append(off)
            if n_enc:
                enc_spans.append((off, off + n_enc))
            if n_dec:
                rows = range(off + n_enc, off + seg.length)
                sc = extra.get("sc_logits")
                if sc is None:
                    plain_rows.extend(rows)
                else:
                    soft_rows.extend(rows)
                    soft.append(sc.reshape(n_dec, -1))
            masks[True].append(segment_masks(seg.start, n_enc, n_dec, self.cfg.sliding_window, dev))
            masks[False].append(segment_masks(seg.start, n_enc, n_dec, None, dev, split_ok))
            off += seg.length
        sc_mod = self.model.self_conditioning
        for rows, s in ((plain_rows, None), (soft_rows, soft)):
            if not rows:
                continue
            emb = None if s is None else self.soft_embeddings(torch.cat(s).to(dev) if len(s) > 1 else s[0].to(dev))
            if len(rows) == x.shape[0]:  # every token is a canvas token of this kind: no gather / scatter
                x = sc_mod(x, emb)
            else:
                r = torch.tensor(rows, device=dev)
                x[r] = sc_mod(x[r], emb)
        enc_rows = None
        if enc_spans:
            enc_rows = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=dev)
            for lo, hi in enc_spans:
                enc_rows[lo:hi] = True
        ctx = _Context(batch.segments, offsets, masks, enc_rows, not (plain_rows or soft_rows))
        cs = self._cos_sin(positions, x.dtype)
        for layer in self.model.layers:
            cos, sin = cs[SLIDING if layer.self_attn.sliding else FULL]
            x = layer(x, cos, sin, ctx)
        return self.model.norm(x)

    def logits(self, hidden: Tensor) -> Tensor:
        out = self.lm_head(hidden).float()
        cap = self.cfg.softcap
        return torch.tanh(out / cap) * cap if cap else out

    def new_cache(self, capacity: int = 256, max_capacity: int | None = None,
                  dtype: torch.dtype | None = None) -> GemmaKVCache:
        a, p = self.cfg, self.lm_head.weight
        if dtype == torch.int8:  # its attention writes and reads the sliding buffers directly (_segment)
            raise InvalidRequestError("an int8 KV cache is not supported for the diffusion_gemma family; choose "
                                      "auto, bfloat16 or float32", "kv_cache_dtype")
        return GemmaKVCache(list(zip(a.kv_heads, a.head_dims)), [t == SLIDING for t in a.layer_types],
                            a.sliding_window, dtype or p.dtype, p.device, capacity, max_capacity)



def _gemma_sequence():
    from unmask.engine.gemma_sequence import GemmaSequence
    return GemmaSequence


DIFFUSION_GEMMA = register(Family(
    name="diffusion_gemma",
    architectures=("DiffusionGemmaForBlockDiffusion",),
    attention="encoder_decoder",
    shift=False,
    default_mask_id=-1,             # no mask token: the canvas starts as uniform noise
    default_block_size=256,
    parse_config=parse_diffusion_gemma,
    block_size_keys=("canvas_length",),
    split_params=to_canonical_names,
    fuse_params=from_canonical_names,
    ignore_params=(r"model\.encoder\.vision_tower\.", r"model\.encoder\.embed_vision\.",
                   r"model\.encoder\.language_model\.", r"lm_head\.weight$"),
    model_class=DiffusionGemmaLM,
    sequence_class=_gemma_sequence(),
))
