"""One decoder-only Transformer for the Llama, Qwen2 and Qwen3 families, over a ragged KV cache.

Serves the policy, the frozen reference and the drafters' decoder layers (`Stack`). Parameter names
follow Hugging Face's (`model.layers.0.self_attn.q_proj.weight`, ...) so a checkpoint's state dict
loads as is (see `weights.py`).

Family differences, all switches of `ModelArgs`:
  * Llama / SmolLM2: optional `attention_bias`, RoPE `default` or `llama3` scaling.
  * Qwen2 / Qwen2.5: bias on q/k/v, none on o.
  * Qwen3: RMSNorm on q and k per head before RoPE.

A cached forward appends its tokens to the cache's speculative region (`kvcache.KVCache`), under any
boolean mask among them (a draft tree); the caller then commits a chosen subset.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from sparkrl.model.kvcache import KVCache
from sparkrl.model.logprobs import head_logprobs

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")


def dense(x: torch.Tensor) -> torch.Tensor:
    """x, contiguous where it has more than 2 dimensions. `F.linear` of a strided N-D input (a slice such
    as hidden[:, 1:]) on a weight that needs no gradient is a batched product over expanded copies of the
    weight, each read in full; a copy of the input rows and one 2-D product cost far less."""
    return x.contiguous() if x.dim() > 2 else x


class Linear(nn.Linear):
    """`nn.Linear` (same parameters and state-dict names) on a dense input (`dense`)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(dense(x), self.weight, self.bias)

    def sibling(self, weight: torch.Tensor) -> "Linear":
        """A frozen layer over `weight` (no bias) that runs as this one does (the CPU layer's kernels
        included): a drafter's head made of rows of the policy's."""
        out = Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
        out.weight = nn.Parameter(weight, requires_grad=False)
        return out


@dataclass(frozen=True)
class ModelArgs:
    """Architecture of one checkpoint, read from its Hugging Face `config.json`."""

    arch: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple = ()  # sorted (key, value) pairs of the HF rope dict, () for plain RoPE
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False

    @classmethod
    def from_hf(cls, cfg: dict) -> "ModelArgs":
        arch = cfg.get("model_type")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported activation {cfg['hidden_act']!r}; only silu is supported")
        if arch == "qwen2" and cfg.get("use_sliding_window"):
            raise ValueError(
                "Qwen2 sliding-window attention is not supported; use a config with use_sliding_window=false"
            )
        # transformers >= 5 writes `rope_parameters`; older configs write rope_theta + rope_scaling.
        rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
        theta = rope.pop("rope_theta", cfg.get("rope_theta", 10000.0))
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3", "linear"):
            raise ValueError(f"unsupported RoPE scaling {rope_type!r}; supported: default, llama3, linear")
        rope = {} if rope_type == "default" else {**rope, "rope_type": rope_type}
        heads = cfg["num_attention_heads"]
        bias = bool(cfg.get("attention_bias", False))
        return cls(
            arch=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=tuple(sorted((k, v) for k, v in rope.items() if not isinstance(v, (list, dict)))),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=True if arch == "qwen2" else bias,
            o_bias=False if arch == "qwen2" else bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch == "qwen3",
        )


def rope_inv_freq(args: ModelArgs) -> torch.Tensor:
    """Inverse frequencies (head_dim/2,) in float64, with llama3 / linear scaling applied."""
    dim = args.head_dim
    inv = 1.0 / (args.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    s = dict(args.rope_scaling)
    if s.get("rope_type") == "linear":
        inv = inv / s["factor"]
    elif s.get("rope_type") == "llama3":
        factor, lo, hi = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
        old = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        smooth = ((old / wavelen) - lo) / (hi - lo)
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wavelen >= old / hi) & (wavelen <= old / lo)
        inv = torch.where(is_mid, mid, scaled)
    return inv


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32:  # fused kernel, same maths
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x = x.to(torch.promote_types(dtype, torch.float32))  # half precision in float32, float64 as it is
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, H, T, D); cos/sin (B, 1, T, D). Hugging Face's rotate-half convention."""
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        H, Hk, D, d = args.num_heads, args.num_kv_heads, args.head_dim, args.hidden_size
        self.q_proj = Linear(d, H * D, bias=args.qkv_bias)
        self.k_proj = Linear(d, Hk * D, bias=args.qkv_bias)
        self.v_proj = Linear(d, Hk * D, bias=args.qkv_bias)
        self.o_proj = Linear(H * D, d, bias=args.o_bias)
        if args.qk_norm:
            self.q_norm = RMSNorm(D, args.rms_norm_eps)
            self.k_norm = RMSNorm(D, args.rms_norm_eps)

    def forward(self, x, cos, sin, layer: int, cache: KVCache | None, ctx: "_Context"):
        B, T, _ = x.shape
        a = self.args
        q, k, v = self.project(x)
        q = q.view(B, T, a.num_heads, a.head_dim)
        k = k.view(B, T, a.num_kv_heads, a.head_dim)
        v = v.view(B, T, a.num_kv_heads, a.head_dim)
        if a.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # (B, H, T, D)
        q, k = self.rope(q, cos, sin), self.rope(k, cos, sin)
        return self.o_proj(self.attend(q, k, v, layer, cache, ctx))

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v of x (B, T, d), each (B, T, heads * head_dim)."""
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rope(x, cos, sin)

    def cache_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a KV cache for weights in `dtype` keeps."""
        return dtype

    def attend(self, q, k, v, layer: int, cache: KVCache | None, ctx: "_Context | None") -> torch.Tensor:
        """Attention of q (B, H, T, D) over k, v (B, Hk, T, D) and what `cache` or `ctx` hold:
        (B, T, H * D) in q's dtype, as o_proj reads it."""
        B, _, T, _ = q.shape
        if cache is None and ctx is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=T > 1, enable_gqa=True)
        elif cache is None:  # an explicit mask among the positions (drafter training)
            if ctx.past is not None:  # after the keys and values of earlier forwards, kept for later ones
                if layer < len(ctx.past):
                    k, v = (torch.cat([old, new], 2) for old, new in zip(ctx.past[layer], (k, v)))
                    ctx.past[layer] = (k, v)
                else:
                    ctx.past.append((k, v))
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=ctx.mask, enable_gqa=True)
        else:
            cache.write(layer, ctx.write_rows, k, v)
            return self.attend_cached(q, cache.k[layer], cache.v[layer], ctx.mask, ctx.span)
        return out.transpose(1, 2).reshape(B, T, -1)

    def attend_cached(
        self, q: torch.Tensor, kbuf: torch.Tensor, vbuf: torch.Tensor, mask: torch.Tensor, span: int
    ) -> torch.Tensor:
        """Attention of q (B, H, T, D) over the first `span` cached positions of kbuf, vbuf (B, Hk, S, D)
        under mask (B, 1, T, span): (B, T, H * D)."""
        B, _, T, _ = q.shape
        out = F.scaled_dot_product_attention(q, kbuf[:, :, :span], vbuf[:, :, :span], attn_mask=mask, enable_gqa=True)
        return out.transpose(1, 2).reshape(B, T, -1)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        d, f, b = args.hidden_size, args.intermediate_size, args.mlp_bias
        self.gate_proj = Linear(d, f, bias=b)
        self.up_proj = Linear(d, f, bias=b)
        self.down_proj = Linear(f, d, bias=b)

    def forward(self, x):
        gate, up = self.gate_up(x)
        return self.down_proj(F.silu(gate) * up)

    def gate_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate_proj(x), self.up_proj(x)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = MLP(args)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps)

    def forward(self, x, cos, sin, layer, cache, ctx):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, layer, cache, ctx)
        return x + self.mlp(self.post_attention_layernorm(x))


@dataclass
class _Context:
    """What every layer of one cached forward shares: where to write K/V, what to attend to."""

    write_rows: torch.Tensor  # (B * H_kv * T,) int64 cache rows of the new tokens (`KVCache.rows`)
    mask: torch.Tensor  # (B, 1, T, span) bool, True = may attend
    span: int  # cache positions [0, span) are read
    past: list | None = None  # without a cache: per layer, (k, v) of earlier forwards (`Stack.forward`'s past)


@dataclass
class Output:
    hidden: torch.Tensor  # (B, T, d) final normed hidden state (enters the LM head)
    taps: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> (B, T, d) layer output


class Stack(nn.Module):
    """Decoder layers and the final norm over input embeddings: RoPE, masks and the ragged cache.

    The policy's `Backbone` adds the token embedding; a drafter builds its own input embeddings.
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.layers = nn.ModuleList(DecoderLayer(args) for _ in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.register_buffer("inv_freq", rope_inv_freq(args).float(), persistent=False)

    def _apply(self, fn, recurse=True):
        """Moves and casts keep the RoPE frequencies in float32 (as transformers does): a bfloat16
        copy of the model would otherwise round them and shift every angle at long positions."""
        super()._apply(fn, recurse)
        self.inv_freq = rope_inv_freq(self.args).float().to(self.inv_freq.device)
        return self

    def _rope(self, positions: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq  # (B, T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # (B, 1, T, D)
        return emb.cos().to(dtype), emb.sin().to(dtype)

    def _slots(self, cache: KVCache, T: int, device) -> tuple[torch.Tensor, int]:
        """The cache positions (B, T) of T new tokens after the committed prefix and the pending ones, and the span
        of positions attention then reads (checked against the capacity)."""
        slots = cache.lengths[:, None] + cache.pending + torch.arange(T, device=device)
        span = int(cache.lengths.max()) + cache.pending + T  # host sync: the attention span
        if span > cache.capacity:
            raise ValueError(f"KV cache capacity {cache.capacity} exceeded ({span} tokens)")
        return slots, span

    def _context(self, cache: KVCache, T: int, tree_mask, device) -> _Context:
        B, P = cache.batch, cache.pending
        base = cache.lengths[:, None]  # (B, 1)
        slots, span = self._slots(cache, T, device)
        keys = torch.arange(span, device=device)
        prefix = keys[None, None, :] < base[:, :, None]  # (B, 1, span)
        rel = keys[None, None, :] - base[:, :, None]  # (B, 1, span) offset into the speculative region
        inside = (rel >= 0) & (rel < P + T)
        if tree_mask is None:  # all pending tokens, then causal among the new ones
            new = inside & (rel <= P + torch.arange(T, device=device)[None, :, None])  # (B, T, span)
        else:
            new = inside & tree_mask.gather(2, rel.clamp(0, P + T - 1).expand(B, T, span))
        return _Context(cache.rows(slots), (prefix | new)[:, None], span)

    def forward(
        self,
        x,
        cache: KVCache | None = None,
        *,
        tree_mask=None,
        depth=None,
        taps=(),
        mask=None,
        past: list | None = None,
    ) -> Output:
        """Run T new positions per sequence; x: (B, T, d) input embeddings.

        Without a cache: a plain causal forward from position 0 (training, scoring; right padding is
        harmless). With a cache: the new positions go after the committed prefix and the `cache.pending`
        speculative tokens of earlier forwards, and attend to the prefix and to the speculative tokens that
        `tree_mask` (B, T, pending + T) allows (default: every pending token, causal among the new ones).
        `depth` (B, T): each new token's RoPE offset from lengths[b] (default pending + t). Nothing is
        committed: call `cache.commit`.
        taps: layer indices whose outputs to return (after the layer, before the final norm).
        mask: without a cache, an explicit (B or 1, 1, T, T) bool attention mask instead of causal (`depth`
        then gives the absolute positions).
        past: with `mask`, a list of each layer's keys and values (with gradients) from the earlier forwards
        that passed it; the new positions attend to those, then to each other, under a mask of (B or 1, 1, T,
        S + T) for S earlier positions, and append their own. EAGLE-3's training-time test extends a sequence
        segment by segment this way, running each position once.
        """
        B, T, _ = x.shape
        device = x.device
        pending = 0 if cache is None else cache.pending
        if depth is None:
            depth = (pending + torch.arange(T, device=device)).expand(B, T)
        ctx = None if mask is None else _Context(None, mask, T, past)
        positions = depth
        if cache is not None:
            positions = cache.lengths[:, None] + depth
            ctx = self._context(cache, T, tree_mask, device)
        cos, sin = self._rope(positions, x.dtype)
        out = Output(hidden=x)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, i, cache, ctx)
            if i in taps:
                out.taps[i] = x
        out.hidden = self.norm(x)
        if cache is not None:
            cache.pending += T
        return out

    def context_kv(self, c: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """DFlash's context: per layer, the keys and values (B, H_kv, T, D) that the layer's own projections make
        of c (B, T, d) at `positions` (B, T) (the key normed per head where the layers are Qwen3's, then RoPE),
        without running any layer."""
        B, T, _ = c.shape
        a = self.args
        cos, sin = self._rope(positions, c.dtype)
        out = []
        for layer in self.layers:
            attn = layer.self_attn
            _, k, v = attn.project(c)
            k = k.view(B, T, a.num_kv_heads, a.head_dim)
            if a.qk_norm:
                k = attn.k_norm(k)
            v = v.view(B, T, a.num_kv_heads, a.head_dim)
            out.append((attn.rope(k.transpose(1, 2), cos, sin), v.transpose(1, 2)))
        return out

    def inject(self, c: torch.Tensor, cache: KVCache, depth: torch.Tensor | None = None) -> None:
        """`context_kv` of c (B, T, d) written as T new pending positions of `cache` (after its committed prefix and
        pending tokens; depth (B, T) as in `forward`). Nothing is committed: call `cache.commit`."""
        B, T, _ = c.shape
        if depth is None:
            depth = (cache.pending + torch.arange(T, device=c.device)).expand(B, T)
        rows = cache.rows(self._slots(cache, T, c.device)[0])  # no attention mask: nothing attends here
        for i, (k, v) in enumerate(self.context_kv(c, cache.lengths[:, None] + depth)):
            cache.write(i, rows, k.to(cache.k[i].dtype), v.to(cache.v[i].dtype))
        cache.pending += T

    def new_cache(self, batch: int, capacity: int, device, dtype) -> KVCache:
        """An empty cache for weights in `dtype`, in the dtype the layers' attention keeps (`cache_dtype`)."""
        return KVCache.empty(self.args, batch, capacity, device, self.layers[0].self_attn.cache_dtype(dtype))


class Backbone(Stack):
    """Hugging Face's `model.` prefix: embeddings, layers, final norm."""

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)


def pad_right(seqs: list[list[int]], device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id lists -> (B, L) int64 right-padded with 0, and (B,) lengths."""
    lens = torch.tensor([len(s) for s in seqs], dtype=torch.long)
    toks = torch.zeros(len(seqs), int(lens.max()), dtype=torch.long)
    for i, s in enumerate(seqs):
        toks[i, : len(s)] = torch.tensor(s, dtype=torch.long)
    return toks.to(device), lens.to(device)


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.model = Backbone(args)
        self.lm_head = Linear(args.hidden_size, args.vocab_size, bias=False)
        if args.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.head32 = ()  # (float32 head weight,) when a half-precision copy computes its logits in float32
        # (`train.precision.inference_copy`); a tuple, so it is not a parameter

    def forward(
        self,
        tokens: torch.Tensor,
        cache: KVCache | None = None,
        *,
        tree_mask=None,
        depth=None,
        taps: tuple[int, ...] = (),
    ) -> Output:
        """tokens (B, T); see `Stack.forward` for the cache, tree mask, depth and taps."""
        return self.model(self.model.embed_tokens(tokens), cache, tree_mask=tree_mask, depth=depth, taps=taps)

    def weights(self) -> dict[str, torch.Tensor]:
        """The state dict with Hugging Face names, the tied output head left out (it is the embedding)."""
        state = self.state_dict()
        if self.args.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        return state

    def load_weights(self, state: dict[str, torch.Tensor]) -> tuple[list[str], list[str]]:
        """Load `weights()`-style state (a tied head may be absent or present); returns (missing,
        unexpected) names."""
        if self.args.tie_word_embeddings:
            state = {k: v for k, v in state.items() if k != "lm_head.weight"}
        missing, unexpected = self.load_state_dict(state, strict=False)
        return [k for k in missing if not (self.args.tie_word_embeddings and k == "lm_head.weight")], unexpected

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """LM head, float32 logits: (..., d) -> (..., V). With `head32`, the product itself runs in float32
        (float32 weights on the upcast hidden states) instead of rounding the logits to the model's dtype."""
        if self.head32:
            return F.linear(dense(hidden.float()), self.head32[0])
        return self.lm_head(hidden).float()

    def token_logprobs(
        self, hidden: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0, keep_logits: bool = False
    ):
        """log softmax(logits(hidden) / T)[targets] (float32, differentiable) without a (..., V) logits tensor
        (`logprobs.head_logprobs`); keep_logits: also return `logits(hidden)` (without a gradient), else None."""
        if self.head32:
            return head_logprobs(hidden.float(), self.head32[0], targets, temperature, keep_logits)
        return head_logprobs(hidden, self.lm_head.weight, targets, temperature, keep_logits)

    def new_cache(self, batch: int, capacity: int) -> KVCache:
        w = self.lm_head.weight
        return self.model.new_cache(batch, capacity, w.device, w.dtype)
