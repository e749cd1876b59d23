"""cuflash.torch.scaled_dot_product_attention against torch.nn.functional.scaled_dot_product_attention itself:
random shapes (lengths both ways, broadcast leading dims, grouped-query heads), boolean and float masks, causal,
scale and dtypes, forward and backward; SDPA's errors; torch.compile; a module whose SDPA is replaced by
cuflash's. And grouped-query heads in cuflash.torch.attention (enable_gqa): views, never copies."""

import random

import pytest

torch = pytest.importorskip("torch")  # conftest stops the run when the test extra is installed without torch

import cuflash.torch as ct  # noqa: E402

F = torch.nn.functional
TOLERANCES = {torch.float64: dict(rtol=1e-9, atol=1e-10), torch.float32: dict(rtol=1e-4, atol=1e-5),
              torch.bfloat16: dict(rtol=2e-2, atol=2e-2), torch.float16: dict(rtol=5e-3, atol=5e-3)}


def leaves(*tensors):
    """Fresh leaf copies (floating ones requiring grad), one set per function compared."""
    return [None if x is None else x.detach().clone().requires_grad_(x.is_floating_point()) for x in tensors]


def run(function, q, k, v, mask, dout, **options):
    """function's result and the gradients of q, k, v and a floating mask given dout."""
    q, k, v, mask = leaves(q, k, v, mask)
    out = function(q, k, v, mask, **options)
    out.backward(dout)
    return out.detach(), [x.grad for x in (q, k, v, mask) if x is not None and x.requires_grad]


def assert_matches_sdpa(q, k, v, mask=None, *, out_tolerance=None, grad_tolerance=None, **options):
    expected_out = F.scaled_dot_product_attention(*leaves(q, k, v, mask), **options)
    dout = torch.randn(expected_out.shape, generator=torch.Generator().manual_seed(1)).to(q.dtype)
    out, grads = run(ct.scaled_dot_product_attention, q, k, v, mask, dout, **options)
    expected, expected_grads = run(F.scaled_dot_product_attention, q, k, v, mask, dout, **options)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    torch.testing.assert_close(out, expected, **(out_tolerance or TOLERANCES[q.dtype]))
    assert len(grads) == len(expected_grads)
    for got, want in zip(grads, expected_grads):
        assert got.shape == want.shape and got.dtype == want.dtype
        torch.testing.assert_close(got, want, **(grad_tolerance or TOLERANCES[q.dtype]))


def randn(shape, dtype, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def random_case(seed):
    """(q, k, v, mask, options) drawn from seed: leading dims that broadcast (sizes dropped to 1, leading ones
    dropped), grouped-query heads with enable_gqa (key and value heads alike, or one a multiple of the other), L
    and S either way round, no mask, a boolean or float mask of any broadcast shape (rows hidden whole included),
    or causal."""
    draw = random.Random(seed)
    dtype = draw.choice([torch.float32, torch.float64])
    L, S, E, Ev = (draw.randint(1, 11) for _ in range(4))
    outer = tuple(draw.randint(1, 3) for _ in range(draw.randint(0, 2)))
    gqa = draw.random() < 0.5
    if gqa:  # key and value heads alike, or one a multiple of the other, dividing the query heads
        few, ratio, group = draw.randint(1, 2), draw.choice([1, 1, 2, 3]), draw.randint(1, 3)
        pair = (few * ratio, few) if draw.random() < 0.5 else (few, few * ratio)
        heads = (few * ratio * group,) + pair
    else:
        h = draw.randint(1, 3)
        heads = (h, draw.choice([h, h, 1]), draw.choice([h, h, 1]))

    def leading(head):  # the outer dims, some of size 1, the first ones maybe dropped
        dims = [draw.choice([size, size, 1]) for size in outer]
        return tuple(dims[draw.randint(0, len(dims)):]) + (head,)
    q = randn(leading(heads[0]) + (L, E), dtype, 3 * seed)
    k = randn(leading(heads[1]) + (S, E), dtype, 3 * seed + 1)
    v = randn(leading(heads[2]) + (S, Ev), dtype, 3 * seed + 2)
    kind = draw.choice(["none", "bool", "float", "causal"])
    mask = None
    if kind in ("bool", "float"):
        core = 3 if gqa else 2  # the mask broadcasts to the weights' leading dims (q's and k's), never beyond
        batch = torch.broadcast_shapes(*(x.shape[:-core] for x in (q, k))) + ((heads[0],) if gqa else ())
        shape = [draw.choice([size, size, 1]) for size in tuple(batch) + (L, S)]
        shape = shape[draw.randint(0, len(shape) - 2):]
        if kind == "bool":
            mask = torch.rand(shape, generator=torch.Generator().manual_seed(seed)) < draw.choice([0.3, 0.8])
        else:
            mask = randn(shape, draw.choice([dtype, torch.float32]), seed)
    options = dict(is_causal=kind == "causal", enable_gqa=gqa)
    if draw.random() < 0.3:
        options["scale"] = draw.uniform(-2, 2)
    return q, k, v, mask, options


@pytest.mark.parametrize("seed", range(150))
def test_matches_sdpa_on_random_shapes_masks_and_heads(seed):
    q, k, v, mask, options = random_case(seed)
    assert_matches_sdpa(q, k, v, mask, **options)


@pytest.mark.parametrize("L, S", [(3, 9), (9, 3), (6, 6), (1, 5), (5, 1)])
def test_causal_is_top_left_aligned_both_ways(L, S):
    """SDPA's is_causal: query i sees keys j <= i whatever L and S (cuflash's own causal= is bottom-right)."""
    q, k, v = randn((2, 3, L, 8), torch.float64, 0), randn((2, 3, S, 8), torch.float64, 1), \
        randn((2, 3, S, 5), torch.float64, 2)
    assert_matches_sdpa(q, k, v, is_causal=True)
    top_left = torch.ones(L, S, dtype=torch.bool).tril()
    torch.testing.assert_close(ct.scaled_dot_product_attention(q, k, v, is_causal=True),
                               ct.attention(q, k, v, mask=top_left))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_rows_that_see_no_key_give_zero_and_zero_gradients_as_sdpa(dtype, kind):
    """A whole row hidden (False, or -inf in a float mask) is 0 in SDPA, and its gradients 0: here too."""
    q, k, v = randn((2, 2, 6, 4), dtype, 0), randn((2, 2, 5, 4), dtype, 1), randn((2, 2, 5, 3), dtype, 2)
    hidden = torch.ones(2, 1, 6, 5, dtype=torch.bool)
    hidden[0, :, 2] = False
    hidden[1, :, 4] = False
    hidden[:, :, 0, 3] = False
    mask = hidden if kind == "bool" else torch.zeros(hidden.shape, dtype=dtype).masked_fill(~hidden, float("-inf"))
    assert_matches_sdpa(q, k, v, mask)
    out = ct.scaled_dot_product_attention(q, k, v, mask)
    assert (out[0, :, 2] == 0).all() and (out[1, :, 4] == 0).all()


def test_empty_keys_give_zeros_as_sdpa():
    q, k, v = randn((2, 3, 4), torch.float32, 0), randn((2, 0, 4), torch.float32, 1), randn((2, 0, 5), torch.float32, 2)
    for causal in (False, True):
        expected = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        torch.testing.assert_close(ct.scaled_dot_product_attention(q, k, v, is_causal=causal), expected)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16_bit_types_match_sdpa_loosely(dtype):
    q, k, v = randn((2, 4, 17, 16), dtype, 0), randn((2, 2, 23, 16), dtype, 1), randn((2, 2, 23, 8), dtype, 2)
    mask = randn((4, 17, 23), torch.float32, 3)  # a float32 mask on 16-bit queries, as SDPA takes
    assert_matches_sdpa(q, k, v, mask, enable_gqa=True)
    assert_matches_sdpa(q, k, v, is_causal=True, enable_gqa=True, scale=0.2)


def test_a_float_mask_gets_its_gradient_in_its_own_shape():
    q, k, v = randn((2, 4, 7, 8), torch.float64, 0), randn((2, 4, 9, 8), torch.float64, 1), \
        randn((2, 4, 9, 8), torch.float64, 2)
    assert_matches_sdpa(q, k, v, randn((4, 1, 9), torch.float64, 3))
    assert torch.autograd.gradcheck(lambda q, k, v, m: ct.scaled_dot_product_attention(q, k, v, m),
                                    leaves(q[:1, :2, :3, :4], k[:1, :2, :5, :4], v[:1, :2, :5, :3],
                                           randn((2, 3, 5), torch.float64, 4)))


def test_grouped_query_keys_and_values_are_never_repeated(monkeypatch):
    """enable_gqa reaches cuflash's operators with k and v as views of the caller's tensors (a size-1 group
    axis), never repeated; their gradients are the sums over the groups, as SDPA's."""
    seen = []
    real = ct.grouped_attention

    def spy(q, k, v, *args):
        seen.append((q, k, v))
        return real(q, k, v, *args)
    monkeypatch.setattr(ct, "grouped_attention", spy)
    q, k, v = randn((2, 8, 5, 4), torch.float32, 0), randn((2, 2, 6, 4), torch.float32, 1), \
        randn((2, 2, 6, 3), torch.float32, 2)
    ct.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    (gq, gk, gv), = seen
    assert gq.shape == (2, 2, 4, 5, 4) and gk.shape == (2, 2, 1, 6, 4) and gv.shape == (2, 2, 1, 6, 3)
    for grouped, given_ in ((gq, q), (gk, k), (gv, v)):
        assert grouped.data_ptr() == given_.data_ptr() and grouped.numel() == given_.numel()


def test_torch_compile_traces_it_whole():
    q, k, v = randn((2, 4, 6, 8), torch.float32, 0), randn((2, 2, 7, 8), torch.float32, 1), \
        randn((2, 2, 7, 8), torch.float32, 2)
    mask = randn((4, 6, 7), torch.float32, 3)

    def loss(q, k, v, mask):
        return (ct.scaled_dot_product_attention(q, k, v, mask, enable_gqa=True) ** 2).sum() + \
            ct.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=0.5).sum()

    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    results = []
    for function in (compiled, loss):
        inputs = leaves(q, k, v, mask)
        value = function(*inputs)
        value.backward()
        results.append((value.detach(), [x.grad for x in inputs]))
    torch.testing.assert_close(results[0][0], results[1][0])
    for got, want in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(got, want)


class Block(torch.nn.Module):
    """Self-attention as models write it: F.scaled_dot_product_attention on grouped-query heads, causal."""

    def __init__(self, width=32, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.d = heads, kv_heads, width // heads
        self.q = torch.nn.Linear(width, width)
        self.kv = torch.nn.Linear(width, 2 * kv_heads * self.d)
        self.o = torch.nn.Linear(width, width)

    def forward(self, x, mask=None):
        b, n, _ = x.shape
        q = self.q(x).view(b, n, self.heads, self.d).transpose(1, 2)
        k, v = self.kv(x).view(b, n, 2, self.kv_heads, self.d).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
        return self.o(out.transpose(1, 2).reshape(b, n, -1))


@pytest.mark.parametrize("model", ["block", "multihead", "encoder"])
def test_modules_calling_sdpa_train_the_same_on_cuflash(model, monkeypatch):
    """A module's F.scaled_dot_product_attention replaced by cuflash's: the same outputs and gradients of every
    parameter (torch's own nn.MultiheadAttention and nn.TransformerEncoderLayer call it too)."""
    torch.manual_seed(0)
    x = torch.randn(3, 10, 32)
    pad = torch.ones(3, 10, dtype=torch.bool)
    pad[1, 7:] = False
    if model == "block":
        module = Block()
        forwards = [lambda: module(x), lambda: module(x, pad[:, None, None, :])]
    elif model == "multihead":
        module = torch.nn.MultiheadAttention(32, 4, batch_first=True)
        causal = torch.nn.Transformer.generate_square_subsequent_mask(10)
        forwards = [lambda: module(x, x, x, need_weights=False, attn_mask=causal)[0],
                    lambda: module(x, x, x, need_weights=False, key_padding_mask=~pad)[0]]
    else:
        module = torch.nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        forwards = [lambda: module(x, src_key_padding_mask=~pad)]
    module.train()
    calls = []
    ours = ct.scaled_dot_product_attention

    def counted(*args, **kwargs):
        calls.append(1)
        return ours(*args, **kwargs)
    for forward in forwards:
        results = []
        for patched in (False, True):
            with monkeypatch.context() as patch:
                if patched:
                    patch.setattr(torch.nn.functional, "scaled_dot_product_attention", counted)
                module.zero_grad()
                out = forward()
                out.square().mean().backward()
                results.append((out.detach(), [p.grad.clone() for p in module.parameters()]))
        torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-4, atol=1e-5)
        for got, want in zip(results[0][1], results[1][1]):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    assert len(calls) == len(forwards)


# ----------------------------------------------------------------------------------------------------------------
# Errors: where SDPA (its reference, the math backend) raises, so does cuflash's, with the same type


def r(*shape, dtype=torch.float32):
    return randn(shape, dtype, 0)


ERRORS = {
    "dtypes differ": lambda f: f(r(1, 2, 5, 4), r(1, 2, 3, 4, dtype=torch.float64), r(1, 2, 3, 4)),
    "a float mask of another dtype": lambda f: f(r(1, 2, 5, 4), r(1, 2, 3, 4), r(1, 2, 3, 4),
                                                 torch.zeros(5, 3, dtype=torch.float16)),
    "an integer mask": lambda f: f(r(1, 2, 5, 4), r(1, 2, 3, 4), r(1, 2, 3, 4), torch.zeros(5, 3, dtype=torch.int64)),
    "is_causal with a mask": lambda f: f(r(1, 2, 5, 4), r(1, 2, 3, 4), r(1, 2, 3, 4),
                                         torch.ones(5, 3, dtype=torch.bool), is_causal=True),
    "heads without enable_gqa": lambda f: f(r(1, 4, 5, 4), r(1, 2, 3, 4), r(1, 2, 3, 4)),
    "heads that do not divide": lambda f: f(r(1, 3, 5, 4), r(1, 2, 3, 4), r(1, 2, 3, 4), enable_gqa=True),
    "more key heads than query heads": lambda f: f(r(1, 2, 5, 4), r(1, 4, 3, 4), r(1, 4, 3, 4), enable_gqa=True),
    "a one-dimensional query": lambda f: f(r(4), r(3, 4), r(3, 4)),
    "head dims differ": lambda f: f(r(1, 2, 5, 4), r(1, 2, 3, 5), r(1, 2, 3, 4)),
    "key and value lengths differ": lambda f: f(r(1, 2, 5, 4), r(1, 2, 3, 4), r(1, 2, 4, 4)),
    "a mask of other lengths": lambda f: f(r(1, 2, 5, 4), r(1, 2, 3, 4), r(1, 2, 3, 4),
                                           torch.ones(4, 3, dtype=torch.bool)),
    "a mask that enlarges the batch": lambda f: f(r(1, 2, 5, 4), r(1, 2, 3, 4), r(1, 2, 3, 4),
                                                  torch.ones(3, 1, 2, 5, 3, dtype=torch.bool)),
    "a mask of other heads under enable_gqa": lambda f: f(r(1, 4, 5, 4), r(1, 2, 3, 4), r(1, 2, 3, 4),
                                                          torch.ones(2, 5, 3, dtype=torch.bool), enable_gqa=True),
    "an is_causal that is no bool": lambda f: f(r(1, 2, 5, 4), r(1, 2, 3, 4), r(1, 2, 3, 4), is_causal=1),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_errors_are_sdpa_errors(case):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel(SDPBackend.MATH), pytest.raises(Exception) as theirs:
        ERRORS[case](F.scaled_dot_product_attention)
    with pytest.raises(theirs.type) as ours:
        ERRORS[case](ct.scaled_dot_product_attention)
    assert "cuflash.torch.scaled_dot_product_attention" in str(ours.value)


def test_heads_without_enable_gqa_say_how():
    with pytest.raises(RuntimeError, match="enable_gqa=True"):
        ERRORS["heads without enable_gqa"](ct.scaled_dot_product_attention)


def test_dropout_p_as_sdpa_takes_it():
    """dropout_p = 0 is the plain call; above 0 it drops (tests/test_dropout_calls.py holds its law), and a p
    outside [0, 1) is an error."""
    q = r(1, 2, 5, 4)
    torch.testing.assert_close(ct.scaled_dot_product_attention(q, q, q, dropout_p=0.0),
                               F.scaled_dot_product_attention(q, q, q))
    assert not torch.equal(ct.scaled_dot_product_attention(q, q, q, dropout_p=0.5),
                           F.scaled_dot_product_attention(q, q, q))
    with pytest.raises(ValueError, match="dropout_p must be in"):
        ct.scaled_dot_product_attention(q, q, q, dropout_p=1.0)


def test_scale_and_enable_gqa_are_keywords_only_as_in_sdpa():
    q = r(1, 2, 5, 4)
    with pytest.raises(TypeError):
        ct.scaled_dot_product_attention(q, q, q, None, 0.0, False, 0.5)
    with pytest.raises(TypeError):
        F.scaled_dot_product_attention(q, q, q, None, 0.0, False, 0.5)


# ----------------------------------------------------------------------------------------------------------------
# cuflash.torch.attention with grouped-query heads


def test_attention_without_enable_gqa_says_how_to_group():
    q, k = r(2, 4, 6, 8), r(2, 2, 7, 8)
    with pytest.raises(ValueError, match=r"enable_gqa=True.*reshape q to \(\.\.\., 2, 2, n, d\)"):
        ct.attention(q, k, k)


def test_attention_with_enable_gqa_is_attention_over_repeated_heads_with_every_keyword():
    """enable_gqa against k and v repeated by hand, with a bias, a mask, mods of (b, h, i, j) (a learnable
    per-head slope) and per-head sinks: the same results and the same gradients (k's and v's summed over
    their groups), all in their own shapes."""
    q, k, v = leaves(r(2, 6, 7, 8, dtype=torch.float64), r(2, 3, 9, 8, dtype=torch.float64),
                     r(2, 3, 9, 5, dtype=torch.float64))
    slopes, sinks, bias = leaves(torch.rand(6, dtype=torch.float64), r(6, dtype=torch.float64),
                                 r(6, 1, 9, dtype=torch.float64))
    mask = torch.rand(2, 1, 7, 9, generator=torch.Generator().manual_seed(2)) < 0.8

    def score_mod(score, b, h, i, j):
        return score - slopes[h] * (i - j).abs()

    def mask_mod(b, h, i, j):
        return (j <= i + 2) | (h == 5)
    options = dict(score_mod=score_mod, mask_mod=mask_mod, sinks=sinks, bias=bias, mask=mask, return_lse=True)
    out, lse = ct.attention(q, k, v, enable_gqa=True, **options)
    assert out.shape == (2, 6, 7, 5) and lse.shape == (2, 6, 7)
    dout = torch.randn(out.shape, dtype=torch.float64)
    out.backward(dout)
    operands = (q, k, v, slopes, sinks, bias)
    grads = [x.grad.clone() for x in operands]
    for x in operands:
        x.grad = None
    expected, expected_lse = ct.attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), **options)
    expected.backward(dout)
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(lse, expected_lse)
    for got, x in zip(grads, operands):
        assert got.shape == x.shape
        torch.testing.assert_close(got, x.grad)


def test_attention_with_enable_gqa_refuses_what_it_cannot_group():
    q, k = r(2, 4, 6, 8), r(2, 2, 7, 8)
    with pytest.raises(ValueError, match="divide"):
        ct.attention(r(2, 3, 6, 8), k, k, enable_gqa=True)
    with pytest.raises(ValueError, match="head axis"):
        ct.attention(r(6, 8), r(7, 8), r(7, 8), enable_gqa=True)
    with pytest.raises(ValueError, match="must be 1 or 4"):
        ct.attention(q, k, k, bias=r(2, 6, 7), enable_gqa=True)
    with pytest.raises(ValueError, match="one of them divides the other"):
        ct.attention(r(1, 6, 5, 4), r(1, 2, 3, 4), r(1, 3, 3, 4), enable_gqa=True)
    with pytest.raises(TypeError, match="score_mod must take 5 arguments"):
        ct.attention(q, k, k, score_mod=lambda s, b, i, j: s, enable_gqa=True)
    import cuflash
    block_mask = cuflash.block_mask(lambda b, h, i, j: j <= i, (2, 4), 6, 7)
    with pytest.raises(ValueError, match="block_mask"):
        ct.attention(q, k, k, block_mask=block_mask, enable_gqa=True)


def test_masks_sdpa_refuses_by_accident_broadcast_here():
    """A 0-d or 1-d mask broadcasts as a (1, 1) or (1, S) one would (SDPA raises IndexError), and a mask may
    broadcast over value's leading dims (SDPA adds it to query's and key's broadcast only)."""
    q, k, v = r(2, 3, 5, 4), r(2, 3, 6, 4), r(2, 3, 6, 2)
    keys = torch.tensor([True, False, True, True, False, True])
    torch.testing.assert_close(ct.scaled_dot_product_attention(q, k, v, keys),
                               F.scaled_dot_product_attention(q, k, v, keys[None]))
    torch.testing.assert_close(ct.scaled_dot_product_attention(q, k, v, torch.tensor(0.5)),
                               F.scaled_dot_product_attention(q, k, v))
    q, k, v = r(1, 3, 5, 4), r(1, 3, 6, 4), r(2, 3, 6, 2)
    mask = randn((2, 3, 5, 6), torch.float32, 5)
    expected = F.scaled_dot_product_attention(q.expand(2, -1, -1, -1), k, v, mask)
    torch.testing.assert_close(ct.scaled_dot_product_attention(q, k, v, mask), expected)
