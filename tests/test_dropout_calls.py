"""Attention dropout through every entry point: the front door's arguments and seeds, the numpy backend against
the dense formula with cuflash.dropout_mask's elements (forward and backward, any tiles), packed sequences, Dask
arrays, cuflash.torch (gradcheck, torch.manual_seed, torch.compile, grouped heads, SDPA's drop-in) and
transformers' training mode. The kernels' side (the same elements on the simt backend, bit for bit) is
tests/test_dropout.py's."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cuflash
from strategies import randn


def dense(q, k, v, keep, p, causal=False):
    """softmax(q k^T / sqrt(d), causal bottom-right) * keep / (1 - p) @ v in float64, and its lse."""
    n, m = q.shape[-2], k.shape[-2]
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if causal:
        s = np.where(np.tril(np.ones((n, m), bool), m - n), s, -np.inf)
    top = s.max(-1, keepdims=True)
    with np.errstate(invalid="ignore"):  # a row that sees nothing: NaN here, left out by the callers
        e = np.exp(s - top)
    total = e.sum(-1, keepdims=True)
    return (e / total * keep / (1 - p)) @ v, (np.log(total) + top)[..., 0]


@given(st.integers(1, 40), st.integers(1, 50), st.sampled_from([0.1, 0.5, 0.9]), st.booleans(),
       st.integers(0, 2**64 - 1), st.sampled_from([None, (8, 16), (5, 3)]))
@settings(max_examples=30, deadline=None)
def test_the_numpy_backend_keeps_dropout_masks_elements(n, m, p, causal, seed, block):
    """Forward against the dense formula with the elements dropout_mask keeps, for any tiles (lse is the
    softmax's, untouched by dropout); the backward against torch autograd of the same formula."""
    torch = pytest.importorskip("torch")
    q, k, v = randn(1, (2, 3, n, 8), np.float64), randn(2, (2, 3, m, 8), np.float64), randn(3, (2, 3, m, 5),
                                                                                           np.float64)
    keep = cuflash.dropout_mask((2, 3), n, m, p=p, seed=seed)
    out, lse = cuflash.attention(q, k, v, causal=causal, dropout_p=p, seed=seed, block=block, return_lse=True)
    expected, expected_lse = dense(q, k, v, keep, p, causal)
    visible = np.isfinite(expected_lse)
    np.testing.assert_allclose(out[visible], expected[visible], rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(lse[visible], expected_lse[visible], rtol=1e-12)
    dout = randn(4, out.shape, np.float64)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, dropout_p=p, seed=seed, block=block)
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    s = tq @ tk.transpose(-1, -2) / np.sqrt(8)
    if causal:
        s = s.masked_fill(~torch.ones(n, m, dtype=torch.bool).tril(m - n), -float("inf"))
    weights = torch.nan_to_num(torch.softmax(s, -1))  # a row that sees nothing: 0
    ((weights * torch.tensor(keep) / (1 - p)) @ tv).backward(torch.tensor(dout))
    for got, x in zip(grads, (tq, tk, tv)):
        np.testing.assert_allclose(got, x.grad.numpy(), rtol=1e-9, atol=1e-9)


def test_dropout_mask_is_the_rule_and_its_law():
    """dropout_mask: deterministic in the seed, different seeds and batch items differ, the keep rate is 1 - p
    within a few standard deviations, rows and seeds independent (correlations near 0)."""
    mask = cuflash.dropout_mask((4, 8), 256, 256, p=0.3, seed=123)
    assert mask.shape == (4, 8, 256, 256) and mask.dtype == bool
    assert np.array_equal(mask, cuflash.dropout_mask((4, 8), 256, 256, p=0.3, seed=123))
    count = mask.size
    assert abs(mask.mean() - 0.7) < 5 * np.sqrt(0.21 / count)
    other = cuflash.dropout_mask((4, 8), 256, 256, p=0.3, seed=124)
    for a, b in ((mask, other), (mask[:, :, :-1], mask[:, :, 1:]), (mask[0], mask[1]), (mask[:, 0], mask[:, 1])):
        corr = np.corrcoef(a.ravel(), b.ravel())[0, 1]
        assert abs(corr) < 5 / np.sqrt(a.size), corr
    for p in (0.05, 0.5, 0.95):
        kept = cuflash.dropout_mask((16,), 128, 128, p=p, seed=7).mean()
        assert abs(kept - (1 - p)) < 5 * np.sqrt(p * (1 - p) / (16 * 128 * 128)), (p, kept)
    assert cuflash.dropout_mask((2,), 3, 4, p=0.0, seed=None).all()


def test_the_same_elements_whatever_the_batch_layout():
    """The batch index is the element's place in the broadcast batch, row-major: a (2, 3) batch keeps what the
    same problem as (6,) keeps; grouped heads (B, Hk, G) keep what (B, H) keeps."""
    q, k, v = randn(1, (2, 3, 9, 4), np.float64), randn(2, (2, 3, 11, 4), np.float64), randn(3, (2, 3, 11, 4),
                                                                                          np.float64)
    a = cuflash.attention(q, k, v, dropout_p=0.5, seed=5)
    b = cuflash.attention(q.reshape(6, 9, 4), k.reshape(6, 11, 4), v.reshape(6, 11, 4), dropout_p=0.5, seed=5)
    np.testing.assert_array_equal(a.reshape(b.shape), b)
    shared_k, shared_v = k[:, :1], v[:, :1]  # one key head for 3 query heads: (2, 1, 3, n, d) by broadcasting
    grouped = cuflash.attention(q[:, None], shared_k[:, :, None], shared_v[:, :, None], dropout_p=0.5, seed=5)
    plain = cuflash.attention(q, np.broadcast_to(shared_k, k.shape), np.broadcast_to(shared_v, v.shape),
                              dropout_p=0.5, seed=5)
    np.testing.assert_array_equal(grouped[:, 0], plain)


def test_seeds_arguments_and_errors():
    q = randn(1, (2, 5, 4), np.float64)
    np.random.seed(0)
    out = cuflash.attention(q, q, q, dropout_p=0.4)
    seed = cuflash.last_seed()
    np.testing.assert_array_equal(out, cuflash.attention(q, q, q, dropout_p=0.4, seed=seed))
    np.random.seed(0)
    np.testing.assert_array_equal(out, cuflash.attention(q, q, q, dropout_p=0.4))  # np.random.seed reproduces
    _, lse = cuflash.attention(q, q, q, dropout_p=0.4, seed=seed, return_lse=True)
    grads = cuflash.attention_backward(np.ones_like(out), q, q, q, out, lse, dropout_p=0.4, seed=seed)
    assert all(np.isfinite(g).all() for g in grads)
    np.testing.assert_array_equal(cuflash.attention(q, q, q, dropout_p=0.0), cuflash.attention(q, q, q))
    with pytest.raises(ValueError, match="needs the forward's seed"):
        cuflash.attention_backward(np.ones_like(out), q, q, q, out, lse, dropout_p=0.4)
    for bad, error in ((1.0, ValueError), (-0.1, ValueError), ("0.1", TypeError), (True, TypeError)):
        with pytest.raises(error, match="dropout_p must be"):
            cuflash.attention(q, q, q, dropout_p=bad)
    for bad in (-1, 2**64, 1.5, True):
        with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\^64\)"):
            cuflash.attention(q, q, q, dropout_p=0.1, seed=bad)


def test_packed_sequences_drop_as_each_sequence_alone():
    """attention_varlen: sequence s's head h keeps the elements of batch item s * H + h, positions inside the
    sequence; its backward regenerates them (against torch autograd of each sequence's dense formula)."""
    torch = pytest.importorskip("torch")
    lengths = [5, 0, 12, 7]
    cu = np.concatenate([[0], np.cumsum(lengths)])
    q, k, v = (randn(seed, (cu[-1], 4 if seed == 1 else 2, 8), np.float64) for seed in (1, 2, 3))
    out, lse = cuflash.attention_varlen(q, k, v, cu, cu, causal=True, dropout_p=0.5, seed=3, return_lse=True)
    dout = randn(4, out.shape, np.float64)
    grads = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu, cu, causal=True, dropout_p=0.5, seed=3)
    keep = cuflash.dropout_mask((len(lengths), 4), max(lengths), max(lengths), p=0.5, seed=3)
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    for s, n in enumerate(lengths):
        if n == 0:
            continue
        rows = slice(cu[s], cu[s + 1])
        q_s = tq[rows].transpose(0, 1)
        k_s, v_s = (x[rows].repeat_interleave(2, 1).transpose(0, 1) for x in (tk, tv))
        scores = (q_s @ k_s.transpose(-1, -2) / 8 ** 0.5).masked_fill(~torch.ones(n, n).bool().tril(), -np.inf)
        expected = (torch.softmax(scores, -1) * torch.tensor(keep[s, :, :n, :n]) / 0.5) @ v_s
        np.testing.assert_allclose(out[rows].transpose(1, 0, 2), expected.detach().numpy(), rtol=1e-10, atol=1e-12)
        expected.backward(torch.tensor(dout[rows].transpose(1, 0, 2)))
    for got, x in zip(grads, (tq, tk, tv)):
        np.testing.assert_allclose(got, x.grad.numpy(), rtol=1e-9, atol=1e-10)


def test_dask_keeps_what_the_whole_call_keeps():
    da = pytest.importorskip("dask.array")
    import cuflash.dask
    q, k, v = (randn(seed, (2, 3, 70, 8), np.float64) for seed in (1, 2, 3))
    expected = cuflash.attention(q, k, v, causal=True, dropout_p=0.4, seed=11)
    chunked = [da.from_array(x, chunks=(1, 2, 25, 8)) for x in (q, k, v)]
    got = cuflash.dask.attention(*chunked, causal=True, dropout_p=0.4, seed=11).compute()
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-14)


# ----------------------------------------------------------------------------------------------------------------
# cuflash.torch


def test_torch_dropout_trains_reproducibly():
    """Seeds from torch's generator (torch.manual_seed reproduces a step; two steps differ); gradients by
    gradcheck with a fixed seed, through the custom operators, the autograd function (sinks), grouped heads, packed
    sequences and SDPA's drop-in; torch.compile traces it."""
    torch = pytest.importorskip("torch")
    import cuflash.torch as ct
    q, k, v = (torch.randn(2, 4, 9, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    torch.manual_seed(5)
    first = ct.attention(q, k, v, dropout_p=0.3, causal=True)
    second = ct.attention(q, k, v, dropout_p=0.3, causal=True)
    torch.manual_seed(5)
    assert torch.equal(first, ct.attention(q, k, v, dropout_p=0.3, causal=True)) and not torch.equal(first, second)
    keep = torch.tensor(cuflash.dropout_mask((2, 4), 9, 9, p=0.3, seed=9))
    weights = torch.softmax((q @ k.transpose(-1, -2) / 8 ** 0.5).masked_fill(~torch.ones(9, 9).bool().tril(),
                                                                            -float("inf")), -1)
    torch.testing.assert_close(ct.attention(q, k, v, dropout_p=0.3, seed=9, causal=True),
                               (weights * keep / 0.7) @ v)
    sinks = torch.zeros(4, dtype=torch.float64, requires_grad=True)
    for call in (lambda q, k, v: ct.attention(q, k, v, dropout_p=0.3, seed=9, causal=True),
                 lambda q, k, v: ct.attention(q, k, v, dropout_p=0.3, seed=9, sinks=sinks),
                 lambda q, k, v: ct.attention(q, k[:, :2], v[:, :2], dropout_p=0.3, seed=9, enable_gqa=True)):
        assert torch.autograd.gradcheck(call, (q, k, v))
    compiled = torch.compile(lambda q, k, v: ct.attention(q, k, v, dropout_p=0.3, seed=9), backend="aot_eager",
                             fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), ct.attention(q, k, v, dropout_p=0.3, seed=9))
    cu = torch.tensor([0, 4, 9])
    qp, kp, vp = (x[0].transpose(0, 1).detach().clone().requires_grad_() for x in (q, k, v))
    assert torch.autograd.gradcheck(lambda q, k, v: ct.attention_varlen(q, k, v, cu, cu, dropout_p=0.4, seed=2),
                                    (qp, kp, vp))


def test_sdpa_drops_as_sdpa_does():
    """scaled_dot_product_attention(dropout_p=p): the kept weights scaled by 1 / (1 - p) (its expectation is the
    plain call's: the mean over many seeds approaches it), p = 0 the plain call."""
    torch = pytest.importorskip("torch")
    import cuflash.torch as ct
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 4, dtype=torch.float64) for _ in range(3))
    plain = ct.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(ct.scaled_dot_product_attention(q, k, v, dropout_p=0.0), plain)
    mean = sum(ct.scaled_dot_product_attention(q, k, v, dropout_p=0.5) for _ in range(400)) / 400
    assert (mean - plain).abs().max() < 0.25
    assert not torch.equal(ct.scaled_dot_product_attention(q, k, v, dropout_p=0.5), plain)


def test_transformers_training_mode_drops_and_eval_does_not():
    """A Llama with attention dropout: in training its attention drops (outputs differ from eval's, the same
    again after torch.manual_seed), in eval it matches transformers' eager attention."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    import cuflash.torch as ct
    name = ct.register_with_transformers()
    config = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, attention_dropout=0.3)
    torch.manual_seed(0)
    reference = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config, attn_implementation="eager"))
    ours = transformers.LlamaForCausalLM(transformers.LlamaConfig(**config, attn_implementation="eager"))
    ours.load_state_dict(reference.state_dict())
    ours.set_attn_implementation(name)
    ids = torch.randint(0, 97, (2, 13), generator=torch.Generator().manual_seed(1))
    ours.train()
    torch.manual_seed(3)
    trained = ours(input_ids=ids, use_cache=False).logits
    trained.square().mean().backward()
    assert all(torch.isfinite(p.grad).all() for p in ours.parameters() if p.grad is not None)
    torch.manual_seed(3)
    torch.testing.assert_close(ours(input_ids=ids, use_cache=False).logits, trained)
    ours.eval()
    reference.eval()
    with torch.no_grad():
        evaluated = ours(input_ids=ids).logits
        torch.testing.assert_close(evaluated, reference(input_ids=ids).logits, rtol=1e-4, atol=1e-5)
    assert (evaluated - trained.detach()).abs().max() > 1e-3
