"""cuflash.torch.attention with grouped-query heads (enable_gqa): views, never copies."""

import pytest

torch = pytest.importorskip("torch")  # conftest stops the run when the test extra is installed without torch

import cuflash.torch as ct  # noqa: E402


def leaves(*tensors):
    """Fresh leaf copies (floating ones requiring grad), one set per function compared."""
    return [None if x is None else x.detach().clone().requires_grad_(x.is_floating_point()) for x in tensors]


def randn(shape, dtype, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def r(*shape, dtype=torch.float32):
    return randn(shape, dtype, 0)


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
