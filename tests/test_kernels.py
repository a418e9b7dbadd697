"""Linear layers' fast paths (`kernels.Linear`): prepacked and weight-major products against float64
references, staleness, gradients, copies, and the measured decisions."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from sparkrl.cpu import accelerate as cpu_layer
from sparkrl.cpu import native
from sparkrl.cpu.accelerate import CpuAttention, CpuRMSNorm, accelerate
from sparkrl.cpu.kernels import (
    PACKED_WEIGHT_MAJOR_ROWS,
    WEIGHT_MAJOR_ROWS,
    is_packed,
    linears,
    pack,
    packable,
    weight_major_linear,
)
from sparkrl.cpu.kernels import CpuLinear as Linear
from sparkrl.model.transformer import apply_rope
from sparkrl.train.precision import inference_copy

BF16, F32 = torch.bfloat16, torch.float32
needs_packing = pytest.mark.skipif(not packable(BF16, "cpu"), reason="this torch/CPU cannot prepack bfloat16 weights")
needs_f32_packing = pytest.mark.skipif(not packable(F32, "cpu"), reason="no oneDNN in this torch")
PACKED_DTYPES = [pytest.param(BF16, marks=needs_packing), pytest.param(F32, marks=needs_f32_packing)]


def _layer(n_in, n_out, bias, seed=0, dtype=BF16):
    torch.manual_seed(seed)
    lin = Linear(n_in, n_out, bias=bias)
    with torch.no_grad():
        lin.weight.normal_()
        if bias:
            lin.bias.normal_()
    return lin.to(dtype).requires_grad_(False)


def _close_to_float64(y, x, lin):
    """y within the dtype's rounding of the float64 product (accumulation error scaled by |x| |w|)."""
    ref = F.linear(x.double(), lin.weight.double(), None if lin.bias is None else lin.bias.double())
    scale = F.linear(x.double().abs(), lin.weight.double().abs(), None if lin.bias is None else lin.bias.double().abs())
    err = (y.double() - ref).abs()
    tol = 2**-7 if y.dtype == BF16 else 2**-20
    assert bool((err <= tol * scale + 1e-6).all()), float((err / scale).max())


@pytest.mark.parametrize("dtype", PACKED_DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(1, 96), (17, 96), (2, 17, 96), (8, 8, 96)])
def test_packed_linear_matches_a_float64_reference(shape, bias, dtype):
    lin = pack(_layer(96, 160, bias, dtype=dtype))
    x = torch.randn(*shape).to(dtype)
    with torch.no_grad():
        y = lin(x)
    assert lin.packed and lin._pack is not None  # the packed path ran
    assert y.shape == (*shape[:-1], 160) and y.dtype == dtype
    _close_to_float64(y, x, lin)
    plain = F.linear(x, lin.weight, lin.bias)
    assert (y.float() - plain.float()).abs().max() <= 2**-6 * plain.float().abs().max()  # plain F.linear agrees


@pytest.mark.parametrize("dtype", PACKED_DTYPES)
def test_a_changed_weight_is_repacked_never_served_stale(dtype):
    lin = pack(_layer(64, 32, True, dtype=dtype))
    x = torch.randn(5, 64).to(dtype)
    with torch.no_grad():
        before = lin(x)
        lin.weight.mul_(-1)  # in place: the version counter moves
        lin.bias.zero_()
        after = lin(x)
        _close_to_float64(after, x, lin)
        assert not torch.allclose(after.float(), before.float())
        lin.weight.copy_(torch.randn(32, 64))  # as `InferenceCopy.refresh` writes
        _close_to_float64(lin(x), x, lin)


@needs_packing
def test_a_refreshed_rollout_copy_samples_from_the_new_master_weights():
    master = Linear(48, 40, bias=False)
    copy_ = inference_copy(master, BF16, "packed")
    x = torch.randn(2, 48).to(BF16)
    layer = copy_.model
    assert layer.packed and layer is not master
    with torch.no_grad():
        y0 = layer(x)
        master.weight.mul_(2)
        copy_.refresh()
        y1 = layer(x)
    _close_to_float64(y1, x, layer)
    assert torch.allclose(y1.float(), 2 * y0.float(), rtol=2**-6, atol=1e-2)


@pytest.mark.parametrize("dtype", PACKED_DTYPES)
def test_gradients_take_the_plain_path_and_copies_leave_the_pack_behind(dtype):
    lin = pack(_layer(32, 16, True, dtype=dtype).requires_grad_(True))
    x = torch.randn(5, 32).to(dtype).requires_grad_(True)
    y = lin(x)  # gradients on: plain F.linear, bit for bit
    assert torch.equal(y, F.linear(x, lin.weight, lin.bias))
    y.float().sum().backward()
    want = torch.autograd.grad(F.linear(x, lin.weight, lin.bias).float().sum(), (x, lin.weight, lin.bias))
    assert all(torch.equal(got, w) for got, w in zip((x.grad, lin.weight.grad, lin.bias.grad), want))
    with torch.no_grad():
        lin(x)
    twin = copy.deepcopy(lin)
    assert lin._pack is not None and twin._pack is None and twin.packed
    with torch.no_grad():
        assert torch.equal(twin(x), lin(x))


def test_pack_off_restores_the_plain_layer():
    assert not packable(BF16, "meta") and not packable(torch.int8, "cpu")
    for dtype in (F32, BF16):
        lin = pack(Linear(8, 8).to(dtype), packable(dtype, "cpu"))
        assert lin.packed == is_packed(lin) == packable(dtype, "cpu")
        with torch.no_grad():
            lin(torch.randn(8, 8).to(dtype))
        pack(lin, False)
        assert not lin.packed and lin._pack is None


@needs_f32_packing
@pytest.mark.parametrize("rows", sorted({1, PACKED_WEIGHT_MAJOR_ROWS, PACKED_WEIGHT_MAJOR_ROWS + 1, 40}))
def test_a_packed_float32_layer_leaves_the_fewest_rows_to_weight_major_products(rows):
    """Up to `PACKED_WEIGHT_MAJOR_ROWS` rows a weight-major product (and no packed copy made), from there
    the prepacked one; both within float32 rounding of float64; a packed bfloat16 layer never runs
    weight-major."""
    lin = cpu_layer.use_weight_major(pack(_layer(96, 160, True, dtype=F32)))
    x = torch.randn(rows, 96)
    with torch.no_grad():
        y = lin(x)
        _close_to_float64(y, x, lin)
        assert lin.serves_weight_major(x) == (rows <= PACKED_WEIGHT_MAJOR_ROWS) == (lin._pack is None)
        if rows <= PACKED_WEIGHT_MAJOR_ROWS:
            assert torch.equal(y, weight_major_linear(x, lin.weight, lin.bias))
        half = cpu_layer.use_weight_major(_layer(96, 160, True, dtype=BF16))
        half.packed = True  # as `pack` sets it where bfloat16 packs
        assert half.weight_major and not half.serves_weight_major(x.to(BF16))


@pytest.mark.parametrize("dtype", PACKED_DTYPES)
def test_packed_model_and_drafter_follow_the_plain_ones(tiny_llama, dtype):
    from sparkrl.drafters.eagle3 import Eagle3Drafter

    plain = tiny_llama.to(dtype)
    packed = pack(accelerate(copy.deepcopy(plain), "plain").model)
    toks = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        a, b = plain.logits(plain(toks).hidden), packed.logits(packed(toks).hidden)
    assert is_packed(packed) and packed.lm_head.packed and not is_packed(plain)
    assert (a - b).abs().max() < 0.05 * a.abs().max()
    d = Eagle3Drafter(plain.args).to(dtype)
    assert d.bind(packed)._head[0].packed and not is_packed(d.bind(plain)._head[0])  # the head follows the policy


@pytest.mark.parametrize("grad", [False, True])
def test_a_strided_input_is_one_product_not_a_batched_one(grad):
    """A slice such as hidden[:, 1:] through a frozen weight (a drafter's shared head, a rollout copy) goes
    through one 2-D product, forward and backward, not a batched product over copies of the weight; the
    result matches a float64 reference."""
    torch.manual_seed(0)
    lin = Linear(48, 96, bias=True).requires_grad_(False)
    x = torch.randn(5, 7, 48)[:, 1:].requires_grad_(grad)  # (5, 6, 48), not viewable as 2-D
    with torch.profiler.profile() as prof, torch.set_grad_enabled(grad):
        y = lin(x)
        if grad:
            y.square().sum().backward()
    assert "aten::bmm" not in {e.name for e in prof.events()}
    ref = F.linear(x.detach().double(), lin.weight.detach().double(), lin.bias.detach().double())
    assert torch.allclose(y.detach().double(), ref, atol=1e-5)
    if grad:
        assert torch.allclose(x.grad.double(), 2 * ref @ lin.weight.detach().double(), atol=1e-4)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(96,), (1, 96), (17, 96), (2, 17, 96), (0, 96), (3, 50, 96)])
def test_weight_major_product_matches_a_float64_reference(shape, bias):
    torch.manual_seed(0)
    lin = Linear(96, 160, bias=bias).requires_grad_(False)
    lin.weight_major = True
    x = torch.randn(*shape)
    with torch.no_grad():
        y = lin(x)
    assert y.shape == (*shape[:-1], 160) and y.dtype == torch.float32
    ref = F.linear(x.double(), lin.weight.double(), None if lin.bias is None else lin.bias.double())
    assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-5)
    rows = x.numel() // 96
    if 1 <= rows <= WEIGHT_MAJOR_ROWS:
        assert torch.equal(y, weight_major_linear(x, lin.weight, lin.bias))  # the weight-major path ran
    else:  # no rows, or a prefill-sized product: F.linear
        assert torch.equal(y, F.linear(x, lin.weight, lin.bias))
    assert y.is_contiguous()  # row-major, as F.linear's (a transposed view slowed what follows)


@pytest.mark.parametrize("parts", [1, 2, 3, 4, 5, 7])
@pytest.mark.parametrize("rows", [1, 2, 9])
def test_a_weight_major_product_split_into_blocks_matches_a_float64_reference(parts, rows):
    """The weight's output rows in `parts` blocks (one batched product); 160 rows do not split in 3 or 7,
    which then run as one block; a transposed (non-contiguous) weight runs as one block too."""
    torch.manual_seed(0)
    w, b, x = torch.randn(160, 48), torch.randn(160), torch.randn(rows, 48)
    ref = F.linear(x.double(), w.double(), b.double())
    for weight in (w, w.t().contiguous().t()):
        y = weight_major_linear(x, weight, b, parts=parts)
        assert y.shape == (rows, 160) and y.is_contiguous()
        assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-5)
        if rows == 1 and (parts == 1 or 160 % parts or weight is not w):  # one row, one block: F.linear
            assert torch.equal(y, F.linear(x, weight, b))
    assert torch.allclose(weight_major_linear(x, w, b).double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 3, WEIGHT_MAJOR_ROWS + 1])
def test_fused_linears_match_a_float64_reference_and_are_never_served_stale(rows, bias):
    """q/k/v-like layers (48, 16, 16 outputs) over one input: one weight-major product over a cached
    concatenation of their weights, remade after an in-place change (an optimizer step, a refresh) or a
    replaced weight; a prefill-sized input, a gradient-recording forward or a layer without weight-major
    products runs each layer on its own."""
    torch.manual_seed(0)
    layers = [Linear(40, n, bias=bias).requires_grad_(False) for n in (48, 16, 16)]
    cpu_layer.use_weight_major(nn.Sequential(*layers))
    x = torch.randn(rows, 40)

    def check():
        with torch.no_grad():
            ys = linears(x, *layers)
        for y, lin in zip(ys, layers):
            ref = F.linear(x.double(), lin.weight.double(), None if lin.bias is None else lin.bias.double())
            assert torch.allclose(y.double(), ref, rtol=1e-5, atol=1e-5)
        return ys

    check()
    fused = rows <= WEIGHT_MAJOR_ROWS
    assert (layers[0]._fused is not None) == fused and layers[1]._fused is None
    with torch.no_grad():
        layers[1].weight.mul_(-2)  # in place: its version counter moves
        if bias:
            layers[2].bias.add_(1)
    check()
    layers[2].weight = nn.Parameter(torch.randn(16, 40), requires_grad=False)  # another tensor
    check()
    twin = copy.deepcopy(layers[0])
    assert twin._fused is None and twin.weight_major
    with torch.enable_grad():
        x.requires_grad_(True)
        assert all(torch.equal(y, F.linear(x, lin.weight, lin.bias)) for y, lin in zip(linears(x, *layers), layers))
        x.requires_grad_(False)
    cpu_layer.use_weight_major(nn.Sequential(*layers), False)  # off: F.linear each, the fused copy freed
    assert layers[0]._fused is None
    with torch.no_grad():
        assert all(torch.equal(y, F.linear(x, lin.weight, lin.bias)) for y, lin in zip(linears(x, *layers), layers))
    assert layers[0]._fused is None


def test_a_model_with_fused_weight_major_products_follows_the_plain_one(tiny_llama):
    """The whole decode step (q/k/v and gate/up fused) against the plain model, after a weight update."""
    torch.manual_seed(0)
    plain = tiny_llama.requires_grad_(False)
    fast = cpu_layer.use_weight_major(accelerate(copy.deepcopy(plain), "plain").model)
    tokens = torch.randint(0, plain.args.vocab_size, (3, 5))
    for step in range(2):
        outs = []
        for model in (plain, fast):
            cache = model.new_cache(3, 8)
            with torch.no_grad():
                model(tokens[:, :4], cache)
                cache.commit(n_keep=torch.full((3,), 4))
                outs.append(model.logits(model(tokens[:, 4:], cache).hidden[:, -1]))
        assert torch.allclose(outs[0], outs[1], rtol=1e-4, atol=1e-4)
        assert fast.model.layers[0].self_attn.q_proj._fused is not None
        with torch.no_grad():
            for p, q in zip(plain.parameters(), fast.parameters()):
                p.mul_(1.5)
                q.mul_(1.5)


def test_weight_major_serves_only_no_gradient_forwards():
    torch.manual_seed(0)
    lin = Linear(32, 16)
    lin.weight_major = True
    x = torch.randn(4, 32, requires_grad=True)
    y = lin(x)  # gradients on: plain F.linear, bit for bit
    assert torch.equal(y, F.linear(x, lin.weight, lin.bias)) and y.is_contiguous()
    y.sum().backward()
    want = torch.autograd.grad(F.linear(x, lin.weight, lin.bias).sum(), (x, lin.weight, lin.bias))
    assert all(torch.equal(got, w) for got, w in zip((x.grad, lin.weight.grad, lin.bias.grad), want))


needs_native = pytest.mark.skipif(not native.available(), reason="the compiled kernels are not available here")


@needs_native
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 17, 32, 513])
@pytest.mark.parametrize("n_out,n_in", [(1, 8), (5, 13), (162, 96), (7, 1539)])
def test_the_compiled_few_row_product_matches_a_float64_reference(rows, n_out, n_in, bias, dtype):
    """Every tile shape: rows in tiles of 3 and their tails, output rows in blocks of 4 and their tails, inputs
    in steps of 8 values and a scalar remainder; a 3-D input; the float32 or bfloat16 rounding of the float64
    product. bfloat16: the weight widened as it streams, or into a block for more than one tile of rows. A row's
    outputs are the same bits whatever rows are beside it."""
    lin = _layer(n_in, n_out, bias, dtype=dtype)
    torch.manual_seed(1)
    x = torch.randn(rows, n_in).to(dtype)
    y = native.linear(x, lin.weight, lin.bias)
    assert y.shape == (rows, n_out) and y.dtype == dtype and y.is_contiguous()
    _close_to_float64(y, x, lin)
    x3 = torch.randn(1, rows, n_in).to(dtype)  # (1, rows, in): a decode step's shape
    _close_to_float64(native.linear(x3, lin.weight, lin.bias), x3, lin)
    assert torch.equal(y[-1:], native.linear(x[-1:], lin.weight, lin.bias))
    assert torch.equal(y[:1], native.linear(x[:1], lin.weight, lin.bias))


@needs_native
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("weight_major", [True, False])
@pytest.mark.parametrize("packed", [pytest.param(True, marks=needs_f32_packing), False])
def test_layers_run_the_compiled_product_where_it_serves_when_it_is_on(packed, weight_major, dtype):
    """On (`cpu_layer.use_native`): every no-grad product runs the compiled kernel whatever the layer's other
    kernels, a gradient-recording forward does not; q/k/v-style `linears` run it once over the weights
    concatenated; off: as before."""
    if dtype == BF16 and packed:
        pytest.skip("a packed bfloat16 layer is the other case's subject")
    lin = pack(_layer(96, 160, True, dtype=dtype), packed)
    lin.weight_major = weight_major
    for on in (True, False):
        assert cpu_layer.use_native(lin, on) is lin and lin.native is on
        for rows in (1, 2, 5, 32, 33):
            x = torch.randn(rows, 96).to(dtype)
            with torch.no_grad():
                y, product = lin(x), lin.product(x)
            _close_to_float64(y, x, lin)
            assert (product == lin._compiled) == on, (on, rows)  # (bound methods: equal, not one)
            if on:
                assert torch.equal(y, lin._compiled(x, lin.weight, lin.bias))
            elif dtype == F32:  # another kernel: other float32 sums (bfloat16 ones may round alike)
                assert not torch.equal(y, native.linear(x, lin.weight, lin.bias)), (on, rows)
    cpu_layer.use_native(lin, True)
    x = torch.randn(3, 96, requires_grad=True).to(dtype)
    assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))  # gradients on: plain F.linear
    other = cpu_layer.use_native(pack(_layer(96, 48, True, seed=1, dtype=dtype), packed), True)
    other.weight_major = weight_major
    x = torch.randn(1, 4, 96).to(dtype)
    with torch.no_grad():
        fused = linears(x, lin, other)
        assert all(torch.equal(a, l._compiled(x, l.weight, l.bias)) for a, l in zip(fused, (lin, other)))
        assert fused[0].data_ptr() + 160 * fused[0].element_size() == fused[1].data_ptr()  # views of one product
        lin.weight.mul_(2)  # in place (an optimizer step, a refresh): no stale weight, repacked or fused, serves
        _close_to_float64(lin(x), x, lin)
        _close_to_float64(linears(x, lin, other)[0], x, lin)


needs_bf16_dot = pytest.mark.skipif(
    not (native.available() and native.bf16_dot()), reason="this CPU has no bfloat16 dot products (AVX512-BF16)"
)


@needs_bf16_dot
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 513])
@pytest.mark.parametrize("n_out,n_in", [(1, 8), (17, 14), (64, 96), (162, 1538)])
def test_the_bfloat16_dot_product_on_repacked_pairs_matches_a_float64_reference(rows, n_out, n_in, bias):
    """`native.linear` on a weight `native.pack_pairs` repacked: rows in tiles of 6 and every tail, outputs in
    groups of 64 and blocks of 16 and their tails (the zero padding never written), a 3-D input; within
    bfloat16's rounding of the float64 product; a row's outputs do not depend on the rows beside it. An odd
    input size is not repacked."""
    lin = _layer(n_in, n_out, bias, dtype=BF16)
    pairs = native.pack_pairs(lin.weight)
    torch.manual_seed(1)
    x = torch.randn(rows, n_in).to(BF16)
    y = native.linear(x, lin.weight, lin.bias, pairs=pairs)
    assert y.shape == (rows, n_out) and y.dtype == BF16 and y.is_contiguous()
    _close_to_float64(y, x, lin)
    x3 = x[None]  # (1, rows, in): a decode step's shape
    _close_to_float64(native.linear(x3, lin.weight, lin.bias, pairs=pairs), x3, lin)
    assert torch.equal(y[-1:], native.linear(x[-1:], lin.weight, lin.bias, pairs=pairs))
    assert torch.equal(y[:1], native.linear(x[:1], lin.weight, lin.bias, pairs=pairs))
    assert native.pack_pairs(_layer(n_in + 1, n_out, bias, dtype=BF16).weight) is None
    assert native.pack_pairs(lin.weight.float()) is None


@needs_native
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("shape", [(1, 1, 576), (3, 5, 64), (2, 7), (4, 1, 3, 10)])
def test_the_compiled_rms_norm_matches_a_float64_reference(shape, dtype):
    """`native.rms_norm` against the norm computed in float64 from the same inputs, within the dtype's rounding
    (bfloat16: the normalised value and the product each rounded once); a non-contiguous input too."""
    torch.manual_seed(0)
    x, w = (torch.randn(shape) * 3).to(dtype), torch.randn(shape[-1]).to(dtype)
    ref = w.double() * x.double() * torch.rsqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5)
    tol = 2**-7 if dtype == BF16 else 2**-20
    for inp in (x, x.transpose(0, -1).contiguous().transpose(0, -1)):
        y = native.rms_norm(inp, w, 1e-5)
        assert y.shape == x.shape and y.dtype == dtype
        assert bool(((y.double() - ref).abs() <= tol * ref.abs() + 1e-6).all())


@needs_native
@pytest.mark.parametrize("dtype", [F32, BF16])
@pytest.mark.parametrize("D", [8, 64])
def test_the_compiled_rope_matches_a_float64_reference(dtype, D):
    """`native.rope` on a transposed (B, T, H, D) view, as attention passes it, against float64 rotate-half RoPE
    from the same inputs, within the dtype's rounding; bfloat16 rounds as `model.apply_rope` does (equal, also
    for inf, NaN and values whose products round to a tie)."""
    torch.manual_seed(0)
    h = D // 2
    x = torch.randn(2, 5, 3, D).to(dtype).transpose(1, 2)  # (B, H, T, D), not contiguous
    emb = torch.randn(2, 1, 5, h).repeat(1, 1, 1, 2)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    xd, c, s = x.double(), cos.double(), sin.double()
    ref = xd * c + torch.cat((-xd[..., h:], xd[..., :h]), -1) * s
    y = native.rope(x, cos, sin)
    assert y.shape == x.shape and y.is_contiguous() and y.dtype == dtype
    scale = xd.abs() * c.abs() + torch.cat((xd[..., h:], xd[..., :h]), -1).abs() * s.abs()
    tol = 2**-6 if dtype == BF16 else 2**-20
    assert bool(((y.double() - ref).abs() <= tol * scale + 1e-6).all())
    if dtype == BF16:
        assert torch.equal(y, apply_rope(x, cos, sin))
        odd = x.clone()
        odd[0, 0, 0, :4] = torch.tensor([float("inf"), float("nan"), -float("inf"), 3e38])
        odd[0, 1] = (1 + torch.arange(D) / 128).to(dtype)  # products with 16 significant bits: rounding ties
        torch.testing.assert_close(
            native.rope(odd, cos, sin), apply_rope(odd, cos, sin), rtol=0, atol=0, equal_nan=True
        )


@needs_native
@pytest.mark.parametrize("dtypes", [(F32, F32), (F32, BF16), (BF16, BF16)])
@pytest.mark.parametrize("T,D", [(1, 64), (5, 8), (17, 64), (4, 24), (2, 72)])
def test_the_compiled_cached_attention_matches_a_float64_reference(dtypes, T, D):
    """`native.attention` on a transposed q, as attention passes it, over cache buffers longer than the span
    (grouped-query heads, 6 over 2), a ragged mask (one query sees nothing: zeros), against float64 softmax
    attention from the same inputs within float32's rounding (plus the output's), transposed to (B, T, H, D)."""
    dtype, out_dtype = dtypes
    torch.manual_seed(0)
    B, H, Hk, cap, S = 3, 6, 2, 40, 29
    q = torch.randn(B, T, H, D).to(dtype).transpose(1, 2)
    k, v = (torch.randn(B, Hk, cap, D) * 2).to(dtype), torch.randn(B, Hk, cap, D).to(dtype)
    mask = torch.rand(B, 1, T, S) < 0.7
    mask[..., 0] = True
    mask[1, 0, 0] = False
    y = native.attention(q, k, v, mask, S, out_dtype)
    assert y.shape == (B, T, H, D) and y.dtype == out_dtype and y.is_contiguous()
    qd, kd, vd = (
        q.double(),
        k[:, :, :S].double().repeat_interleave(H // Hk, 1),
        v[:, :, :S].double().repeat_interleave(H // Hk, 1),
    )
    scores = (qd @ kd.transpose(-1, -2)) / D**0.5
    ref = torch.softmax(scores.masked_fill(~mask, -float("inf")), -1).nan_to_num(0.0) @ vd  # (B, H, T, D)
    ref = ref.transpose(1, 2)
    tol = 2**-8 if out_dtype == BF16 else 2**-18
    assert bool(((y.double() - ref).abs() <= tol * (ref.abs() + 1)).all())
    assert bool((y[1, 0] == 0).all())
    theirs = F.scaled_dot_product_attention(
        q.float(), k[:, :, :S].float(), v[:, :, :S].float(), attn_mask=mask, enable_gqa=True
    ).transpose(1, 2)
    ok = mask.any(-1)[:, 0]  # (B, T): queries that see something
    assert torch.allclose(y.float()[ok], theirs[ok], atol=2**-7 if out_dtype == BF16 else 1e-5, rtol=0)


@needs_native
def test_the_compiled_norm_and_rope_take_no_gradients():
    x = torch.zeros(3, 576)
    with torch.no_grad():
        assert native.serves_elementwise(x) and native.serves_elementwise(x.bfloat16())
        assert native.serves_elementwise(torch.zeros(4096, 576)) and not native.serves_elementwise(x.half())
    assert not native.serves_elementwise(x)  # gradients recorded: torch's ops


@needs_native
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("dtypes", [(F32, F32), (BF16, BF16)])
@pytest.mark.parametrize("H,Hk", [(6, 2), (4, 2), (3, 3)])
def test_a_row_of_the_compiled_attention_depends_only_on_the_positions_it_sees(threads, dtypes, H, Hk):
    """The same query over the same visible keys and values gives the same bits as one new token of a decode
    step (one sequence, span = its position + 1) and as a node of a tree verified beside others (more new
    tokens, a longer span, its ancestors at scattered cache positions, other sequences in the batch), at any
    thread count and whichever of the values' row tiles (3, 2 or 1 query rows of a key/value head) it falls in:
    what makes greedy speculative rollouts equal greedy AR ones."""
    dtype, out_dtype = dtypes
    torch.manual_seed(0)
    D, L = 64, 37  # L committed positions
    path = [L, L + 3, L + 4, L + 9]  # a tree's path: the node at depth 3 (slot L + 9) sees these four slots
    kv = (torch.randn(2, 1, Hk, L + 13, D) * 2).to(dtype)
    q = torch.randn(1, H, 1, D).to(dtype)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        # a decode step: the same keys and values at consecutive slots, the query the last of them
        kd, vd = (torch.cat([t[:, :, :L], t[:, :, path]], 2).contiguous() for t in kv)
        n = L + len(path)
        step = native.attention(q, kd, vd, torch.ones(1, 1, 1, n, dtype=torch.bool), n, out_dtype)
        # the tree: 13 new tokens of which the node at slot L + 9 is the sixth query row, among 3 sequences
        B, T, S = 3, 13, L + 13
        k, v = (torch.randn(2, B, Hk, S + 5, D) * 2).to(dtype)  # a cache longer than the span
        k[1, :, :S], v[1, :, :S] = kv[0, 0], kv[1, 0]
        qs = torch.randn(B, H, T, D).to(dtype)
        qs[1, :, 5] = q[0, :, 0]
        mask = torch.rand(B, 1, T, S) < 0.5
        mask[1, 0, 5] = False
        mask[1, 0, 5, :L] = True
        mask[1, 0, 5, path] = True
        tree = native.attention(qs, k, v, mask, S, out_dtype)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(tree[1, 5], step[0, 0])


@needs_native
def test_norms_and_rope_run_compiled_only_when_on_and_never_while_training(tiny_llama, monkeypatch):
    """`cpu_layer.use_native` turns the kernels on in every norm and attention; a no-grad forward then matches
    torch's ops within float32 rounding (cached forwards with the compiled attention too), and a gradient-recording
    one is torch's own (differentiable)."""
    model = copy.deepcopy(tiny_llama)
    tokens = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        ref = model(tokens).hidden
        cpu_layer.use_native(accelerate(model, "plain").model, True)
        assert all(m.native for m in model.modules() if isinstance(m, (CpuRMSNorm, CpuAttention)))
        y = model(tokens).hidden
    assert torch.allclose(y, ref, atol=1e-5, rtol=1e-5)
    calls = []
    for name in ("rms_norm", "rope", "attention", "decode_layer"):
        monkeypatch.setattr(native, name, lambda *a, f=getattr(native, name), name=name: calls.append(name) or f(*a))
    out = model(tokens).hidden
    assert out.requires_grad and not calls  # training: torch's ops
    with torch.no_grad():
        model(tokens)
        assert set(calls) == {"rms_norm", "rope"}  # no cache: torch's attention
        cached = []
        for on in (True, False):  # cached chunks: compiled attention against torch's
            cpu_layer.use_native(model, on)
            calls.clear()
            cache = model.new_cache(1, 16)
            cached.append(torch.cat([model(tokens[:, :3], cache).hidden, model(tokens[:, 3:], cache).hidden], 1))
            assert ("decode_layer" in calls) == on  # each layer in one call of the compiled kernels
    assert torch.allclose(cached[0], cached[1], atol=1e-5, rtol=1e-5) and torch.allclose(cached[0], ref, atol=1e-5)
