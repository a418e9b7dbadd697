"""The CPU layer composed into a model at one call: `accelerate(module, choice)` swaps the model's modules for
CPU subclasses (same parameters, same state-dict names, same gradients) and returns the sampler the engine
takes with it. The eager modules of `sparkrl.model` stay the reference semantics; the subclasses differ only
in no-grad CPU forwards:

* `CpuLinear` (`kernels.py`): the compiled product (auto), prepacked oneDNN weights (packed) or weight-major
  products (weight-major); the projections that read one input (q/k/v, gate/up) as one product where the
  compiled or weight-major product serves them (`kernels.linears`);
* `CpuRMSNorm`, `CpuAttention`: the compiled norm, RoPE and cached attention (auto); a half-precision
  model's attention in float32 over a float32 KV cache where `tuning.float32_attention_pays` (packed,
  weight-major);
* `CpuTransformer`: a float32 LM head (`--rollout-head float32`) on the compiled product;
* `CompiledSampler`: the nucleus, token and log-probability of a row of logits in one compiled call.

--cpu-kernels auto (the default) uses the compiled kernels, which compute each row the same way whatever else
the forward carries, so speculative rollouts of point-mass drafts commit the very tokens autoregressive
sampling gives with the same seed. packed, weight-major and plain (torch's kernels) change their order of adds
with the batch: exact in distribution, not token-identical.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from sparkrl.cpu import kernels, native
from sparkrl.cpu.kernels import CpuLinear, compiled, linears, pack, packable
from sparkrl.engine.sampling import SAMPLER, Sampler
from sparkrl.errors import UserError
from sparkrl.model.transformer import MLP, Attention, DecoderLayer, Linear, RMSNorm, Transformer, dense


class CpuRMSNorm(RMSNorm):
    native = False  # the compiled norm (`use_native`)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.native and x.dtype == self.weight.dtype and native.serves_elementwise(x):
            return native.rms_norm(x, self.weight, self.eps)  # one call for the reference's ops
        return super().forward(x)


class CpuAttention(Attention):
    native = False  # the compiled RoPE and cached attention (`use_native`)
    attn_dtype: torch.dtype | None = None  # the dtype attention runs in and the cache keeps, if not the
    # inputs': float32 for a half-precision copy whose own attention is slower here (`use_float32_attention`)

    def project(self, x):
        return linears(x, self.q_proj, self.k_proj, self.v_proj)

    def rope(self, x, cos, sin):
        if self.native and cos.dtype == x.dtype and native.serves_elementwise(x):
            return native.rope(x, cos, sin)
        return super().rope(x, cos, sin)

    def cache_dtype(self, dtype):
        return self.attn_dtype or dtype

    def attend(self, q, k, v, layer, cache, ctx):
        was, dt = q.dtype, self.attn_dtype or q.dtype
        return super().attend(q.to(dt), k.to(dt), v.to(dt), layer, cache, ctx).to(was)

    def attend_cached(self, q, kbuf, vbuf, mask, span):
        if self.native and native.serves_attention(q, kbuf):  # one call, written as o_proj reads it
            B, H, T, D = q.shape
            return native.attention(q, kbuf, vbuf, mask, span, q.dtype).view(B, T, H * D)
        return super().attend_cached(q, kbuf, vbuf, mask, span)


class CpuMLP(MLP):
    def gate_up(self, x):
        return linears(x, self.gate_proj, self.up_proj)


FUSE_LAYERS = True  # a decoder layer's cached forward as one call where it serves; False (a bench knob): the modules


class CpuDecoderLayer(DecoderLayer):
    """A decoder layer whose cached no-grad forward, where the compiled kernels serve all of it, is one call
    (`native.decode_layer`): the same ops on the same kernels as the modules' path, without Python's dispatch
    between them (some 40% of a one-response decode step)."""

    def forward(self, x, cos, sin, layer, cache, ctx):
        fused = FUSE_LAYERS and cache is not None and cache.kv.dtype == x.dtype
        weights = self.compiled_weights(x, cos) if fused else None
        if weights is None:
            return super().forward(x, cos, sin, layer, cache, ctx)
        a = self.self_attn.args
        return native.decode_layer(
            x, cos, sin, cache.k[layer], cache.v[layer], ctx.write_rows, ctx.mask, ctx.span, weights,
            a.num_heads, a.num_kv_heads, a.rms_norm_eps,
        )  # fmt: skip

    def compiled_weights(self, x: torch.Tensor, cos: torch.Tensor) -> list | None:
        """The weights `native.decode_layer` takes, in its order, where the modules would run every op of this
        forward on the compiled kernels; else None. Kept from the last call while nothing that decides them has
        changed (x's dtype, the modules' kernels, their parameters' storage and version counters): working them out
        costs ~0.2 ms a layer, as much as the Python the call saves."""
        if torch.is_grad_enabled():
            return None
        leaves = self.__dict__.get("_leaves") or self._find_leaves()
        tensors = [t for m in leaves for t in m._parameters.values() if t is not None]
        flags = tuple(
            (m.native, m.int8, m.weight_major, m.packed) if isinstance(m, CpuLinear) else m.native for m in leaves
        )
        state = tuple((t.data_ptr(), t._version) for t in tensors)
        key = (x.dtype, x.device, cos.dtype, kernels.FUSE_LINEARS, self.self_attn.attn_dtype, flags, state)
        memo = self.__dict__.get("_memo")
        if memo is None or memo[0] != key:  # memo[1] keeps the tensors alive: no other can take their storage
            self._memo = memo = (key, tensors, self._weights(x, cos))
        return memo[2]

    def _find_leaves(self) -> list[nn.Module]:
        """The modules whose kernels and parameters `_weights` reads."""
        self._leaves = [m for m in self.modules() if isinstance(m, (CpuLinear, CpuRMSNorm, CpuAttention))]
        return self._leaves

    def _weights(self, x: torch.Tensor, cos: torch.Tensor) -> list | None:
        attn, mlp = self.self_attn, self.mlp
        args = attn.args
        norms = [
            self.input_layernorm,
            self.post_attention_layernorm,
            *((attn.q_norm, attn.k_norm) if args.qk_norm else ()),
        ]
        if not (attn.native and attn.attn_dtype is None and cos.dtype == x.dtype and args.head_dim % 8 == 0):
            return None  # `native.serves_attention`'s terms; x's dtype and device are checked by `compiled`
        if any(not n.native or n.weight.dtype != x.dtype or n.eps != args.rms_norm_eps for n in norms):
            return None
        parts = (compiled(x, attn.q_proj, attn.k_proj, attn.v_proj), compiled(x, attn.o_proj),
                 compiled(x, mlp.gate_proj, mlp.up_proj), compiled(x, mlp.down_proj))  # fmt: skip
        if any(p is None for p in parts):
            return None
        qk = [attn.q_norm.weight, attn.k_norm.weight] if args.qk_norm else [None, None]
        qkv, o, gate_up, down = parts
        return [self.input_layernorm.weight, *qkv, *qk, *o, self.post_attention_layernorm.weight, *gate_up, *down]

    def __getstate__(self):  # copies leave the kept weights behind (`CpuLinear.__getstate__` likewise)
        state = self.__dict__.copy()
        state.pop("_memo", None)
        state.pop("_leaves", None)
        return state


class CpuTransformer(Transformer):
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.head32 and self.lm_head.native:
            return native.linear(dense(hidden.float()), self.head32[0])
        return super().logits(hidden)


class CompiledSampler(Sampler):
    """The engine's sampler with the nucleus, token and log-probability of float32 CPU logits in one call of
    the compiled kernel (`native.nucleus`, for temperature > 0 and 0 < top_p < 1; else the reference's); the
    token and its log-probability always from the nucleus."""

    def nucleus(self, logits, temperature, top_p, u):
        if temperature > 0 and 0 < top_p < 1 and logits.dtype == torch.float32 and logits.device.type == "cpu":
            return native.nucleus(logits, temperature, top_p, u)
        return super().nucleus(logits, temperature, top_p, u)

    def token(self, logits, temperature, top_p, u):
        return self.nucleus(logits, temperature, top_p, u)[2:]


COMPILED_SAMPLER = CompiledSampler()
SWAPS = {
    Linear: CpuLinear,
    RMSNorm: CpuRMSNorm,
    Attention: CpuAttention,
    MLP: CpuMLP,
    DecoderLayer: CpuDecoderLayer,
    Transformer: CpuTransformer,
}
EXACT = (DecoderLayer,)  # swapped only where a module is of this very class: a subclass (EAGLE-3's first layer)
# runs a forward of its own, which the swap would replace
CHOICES = ("auto", "packed", "weight-major", "plain")


@dataclass(frozen=True)
class Kernels:
    """The kernels `accelerate` chose for a module under --cpu-kernels `choice` (a run's config, the budget's cost
    model and the corpus caches record them)."""

    choice: str = "plain"  # --cpu-kernels
    packed: bool = False  # prepacked oneDNN weights
    weight_major: bool = False  # weight-major products
    float32_attention: bool = False  # a half-precision module attending in float32 over a float32 KV cache
    compiled: str | None = None  # the compiled kernels' digest, where they serve (`native.digest`)
    int8: bool = False  # the decoder layers' products on 8-bit weights and activations (`use_int8`)

    def key(self) -> dict:
        """The kernels as the measurement caches' keys have always named them (`budget.CostModel.measure`)."""
        compiled = {"native": self.compiled, "ops": self.compiled} if self.compiled else {}
        attention = str(torch.float32 if self.float32_attention else None)
        int8 = {"int8": True} if self.int8 else {}
        return {"packed": self.packed, "weight_major": self.weight_major, "attention": attention, **compiled, **int8}

    def tags(self) -> list[str]:
        """What of the CPU layer runs the module, in words (part of the corpus and feature caches' keys)."""
        named = {"packed": self.packed, "float32 attention": self.float32_attention, "int8": self.int8}
        named |= {"native": bool(self.compiled), "compiled ops": bool(self.compiled)}
        return [name for name, on in named.items() if on]


@dataclass
class Acceleration:
    """What `accelerate` made of a module: the module (the same object, its modules swapped), the sampler the
    engine takes with it, and the kernels chosen."""

    model: nn.Module
    sampler: Sampler = SAMPLER
    kernels: Kernels = Kernels()


def accelerate(module: nn.Module, choice: str = "auto", float32_attention: bool = False) -> Acceleration:
    """Run `module`'s no-grad CPU forwards on the kernels of --cpu-kernels `choice` (see the module doc), in
    place; off a CPU, or where the compiled kernels cannot be built, torch's kernels serve. float32_attention:
    a half-precision module's attention in float32 (`CpuAttention.attn_dtype`; only where torch's attention
    serves: `tuning.float32_attention`)."""
    if choice not in CHOICES:
        raise ValueError(f"cpu kernels {choice!r}: one of {', '.join(CHOICES)}")
    for m in module.modules():
        for cls in type(m).__mro__:
            if cls in SWAPS:
                if cls not in EXACT or cls is type(m):
                    m.__class__ = SWAPS[cls]
                break
    w = next(module.parameters())
    cpu = w.device.type == "cpu"
    packed = choice == "packed" and packable(w.dtype, w.device)
    weight_major = choice == "weight-major" and cpu
    compiled = choice == "auto" and cpu and native.available()
    pack(module, packed)
    use_weight_major(module, weight_major)
    use_native(module, compiled)
    use_float32_attention(module, float32_attention)
    kernels = Kernels(choice, packed, weight_major, float32_attention, native.digest() if compiled else None)
    return Acceleration(module, COMPILED_SAMPLER if compiled else SAMPLER, kernels)


def use_native(module: nn.Module, on: bool = True) -> nn.Module:
    """Run `module`'s no-grad CPU forwards on the compiled kernels (on, where they are available; never off a
    CPU, where they are not even built) or on torch's."""
    on = bool(on) and next(module.parameters()).device.type == "cpu" and native.available()
    for m in module.modules():
        if isinstance(m, CpuLinear):
            m.native = on
            if not on:
                m._pairs = None  # the compiled product's repacked weight
        elif isinstance(m, (CpuRMSNorm, CpuAttention)):
            m.native = on
    return module


def use_int8(module: nn.Module, on: bool = True) -> nn.Module:
    """Run every `CpuLinear` of `module` on 8-bit weights and activations (`native.int8_linear`: one scale per output
    row of the weight, requantized whenever it changes; one per row of the input, quantized as it comes in), or
    not. Only where the compiled kernels run: a clear error elsewhere."""
    if on and not (next(module.parameters()).device.type == "cpu" and native.available()):
        raise UserError("8-bit products (--rollout-dtype int8, --draft self-int8) run on sparkrl's compiled CPU "
                        "kernels, which this machine cannot run (a GPU, or no AVX2 / compiler): use --rollout-dtype "
                        "bfloat16 and another --draft")  # fmt: skip
    for m in module.modules():
        if isinstance(m, CpuLinear):
            m.int8 = on
            if not on:
                m._q = None
    return module


def use_weight_major(module: nn.Module, on: bool = True) -> nn.Module:
    """Run every `CpuLinear` of `module` as a weight-major product (on) where it serves the product
    (`CpuLinear.serves_weight_major`), else as before; off frees the fused weights of `kernels.linears`."""
    for m in module.modules():
        if isinstance(m, CpuLinear):
            m.weight_major = on
            if not on:
                m._fused = None
    return module


def use_float32_attention(module: nn.Module, on: bool = True) -> nn.Module:
    """Run every `CpuAttention` of `module` in float32 with a float32 KV cache (on: queries, keys and values
    cast up, outputs cast back), or in its inputs' dtype; caches made before keep their dtype."""
    for m in module.modules():
        if isinstance(m, CpuAttention):
            m.attn_dtype = torch.float32 if on else None
    return module
