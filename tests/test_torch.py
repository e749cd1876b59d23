"""cuflash.torch: the differentiable adapter on CPU tensors (the numpy backend) against torch's own attention and
the float64 reference; gradcheck in float64; bfloat16 and broadcasting without copies; torch.compile tracing
the operators as opaque nodes."""

import ml_dtypes
import numpy as np
import pytest

torch = pytest.importorskip("torch")  # conftest stops the run when the test extra is installed without torch

import cuflash.torch as ct  # noqa: E402
from reference import assert_accurate, assert_grads_accurate  # noqa: E402


def tensors(shapes, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=generator, dtype=torch.float64).to(dtype).requires_grad_() for shape in shapes]


def as_numpy(t):
    t = t.detach()
    return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16) if t.dtype == torch.bfloat16 else t.numpy()


def test_gradcheck_in_float64():
    q, k, v = tensors([(2, 3, 4), (2, 5, 4), (2, 5, 3)], torch.float64)
    bias = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda q, k, v, b: ct.attention(q, k, v, bias=b, causal=True),
                                    (q, k, v, bias))


@pytest.mark.parametrize("causal", [False, True])
def test_matches_torch_attention_and_its_gradients(causal):
    q, k, v = tensors([(2, 4, 33, 16), (2, 4, 40, 16), (2, 4, 40, 16)])
    out = ct.attention(q, k, v, causal=causal)
    dout = torch.randn_like(out)
    out.backward(dout)
    grads = [x.grad.clone() for x in (q, k, v)]
    q2, k2, v2 = (x.detach().clone().requires_grad_() for x in (q, k, v))
    # torch's causal mask is top-left aligned; cuflash's bottom-right: the same here written as a window.
    expected = torch.nn.functional.scaled_dot_product_attention(
        q2, k2, v2, attn_mask=torch.ones(33, 40, dtype=torch.bool).tril(40 - 33) if causal else None)
    expected.backward(dout)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    for got, want in zip(grads, (q2.grad, k2.grad, v2.grad)):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_grouped_query_bias_and_mask_gradients_against_the_reference():
    """k and v shared by 4 query heads (broadcast, never copied): their gradients are the sums over the group;
    the bias gradient has the bias's own shape; a masked key gets none."""
    q, k, v = tensors([(2, 4, 9, 8), (2, 1, 11, 8), (2, 1, 11, 5)])
    bias = torch.randn(9, 11, requires_grad=True)
    mask = torch.rand(2, 1, 9, 11, generator=torch.Generator().manual_seed(1)) < 0.8
    mask[..., 3] = False
    out = ct.attention(q, k, v, bias=bias, mask=mask, window=(None, 2))
    dout = torch.randn_like(out)
    out.backward(dout)
    assert [x.grad.shape for x in (q, k, v, bias)] == [x.shape for x in (q, k, v, bias)]
    assert (k.grad[..., 3, :] == 0).all() and (v.grad[..., 3, :] == 0).all()
    arrays = [as_numpy(x) for x in (q, k, v)]
    options = {"bias": as_numpy(bias), "mask": mask.numpy(), "window": (None, 2)}
    assert_accurate(as_numpy(out), *arrays, **options)
    assert_grads_accurate([as_numpy(x.grad) for x in (q, k, v, bias)], as_numpy(dout), *arrays, **options)


def test_bfloat16_and_return_lse():
    q, k, v = tensors([(3, 20, 16), (3, 30, 16), (3, 30, 16)], torch.bfloat16)
    out, lse = ct.attention(q, k, v, return_lse=True, scale=0.3)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32 and not lse.requires_grad
    out.float().sum().backward()
    assert all(x.grad.dtype == torch.bfloat16 for x in (q, k, v))
    arrays = [as_numpy(x) for x in (q, k, v)]
    assert_accurate(as_numpy(out), *arrays, lse=lse.numpy(), scale=0.3)
    dout = np.ones(out.shape, dtype=ml_dtypes.bfloat16)
    assert_grads_accurate([as_numpy(x.grad) for x in (q, k, v)], dout, *arrays, scale=0.3)


def test_forward_shares_memory_with_the_tensors():
    """No copies on the way in: a strided view of a tensor is read in place (its other elements are NaN)."""
    base = torch.full((2, 10, 16), float("nan"))
    base[:, ::2] = torch.randn(2, 5, 16)
    q = base[:, ::2]
    out = ct.attention(q, q, q)
    assert torch.isfinite(out).all()
    assert_accurate(out.numpy(), *(q.numpy(),) * 3)


def test_torch_compile_traces_the_operators():
    q, k, v = tensors([(2, 6, 8), (2, 7, 8), (2, 7, 8)])

    def loss(q, k, v):
        return (ct.attention(q, k, v, causal=True) ** 2).sum()

    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    value = compiled(q, k, v)
    value.backward()
    grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    eager = loss(q, k, v)
    eager.backward()
    torch.testing.assert_close(value, eager)
    for got, x in zip(grads, (q, k, v)):
        torch.testing.assert_close(got, x.grad)


def test_fake_tensors_give_the_result_shapes_and_dtypes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q = torch.empty(2, 1, 5, 8, dtype=torch.float16)
        k = torch.empty(3, 7, 8, dtype=torch.float32)
        out, lse = torch.ops.cuflash.attention_forward(q, k, k, None, None, None, False, None, None)
        assert out.shape == (2, 3, 5, 8) and out.dtype == torch.float32 and lse.shape == (2, 3, 5)


# ----------------------------------------------------------------------------------------------------------------
# As the attention of Hugging Face transformers models (their own code; tiny random configurations, no download)


@pytest.fixture
def calls(monkeypatch):
    """Counts cuflash.torch.attention calls: the model must really run through cuflash."""
    count = []
    real = ct.attention

    def counted(*args, **kwargs):
        count.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(ct, "attention", counted)
    return count


def transformers_pair(config_cls, model_cls, **config):
    """The same randomly initialized model twice: with cuflash's attention and with transformers' sdpa."""
    pytest.importorskip("transformers")  # conftest stops the run when the test extra is installed without it
    name = ct.register_with_transformers()
    torch.manual_seed(0)
    reference = model_cls(config_cls(**config, attn_implementation="sdpa")).eval()
    ours = model_cls(config_cls(**config, attn_implementation="sdpa")).eval()  # its own config
    ours.load_state_dict(reference.state_dict())
    ours.set_attn_implementation(name)
    return ours, reference


def test_a_llama_with_grouped_query_attention_and_left_padding(calls):
    from transformers import LlamaConfig, LlamaForCausalLM
    ours, reference = transformers_pair(LlamaConfig, LlamaForCausalLM, vocab_size=97, hidden_size=64,
                                        intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, max_position_embeddings=64)
    ids = torch.randint(0, 97, (2, 19), generator=torch.Generator().manual_seed(3))
    attention_mask = torch.ones(2, 19, dtype=torch.long)
    attention_mask[1, :5] = 0  # left padding
    results = []
    for model in (ours, reference):
        logits = model(input_ids=ids, attention_mask=attention_mask).logits
        loss = (logits[attention_mask.bool()] ** 2).mean()
        loss.backward()
        results.append((logits[attention_mask.bool()].detach(), [p.grad.clone() for p in model.parameters()]))
    assert len(calls) == 2  # one per layer, ours only
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-4, atol=1e-5)
    for got, want in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-5)
    # generation with a cache: one query over its past (bottom-right causal, as transformers means it)
    with torch.no_grad():
        torch.testing.assert_close(ours.generate(ids[:1], max_new_tokens=4, do_sample=False),
                                   reference.generate(ids[:1], max_new_tokens=4, do_sample=False))


def test_generation_with_padding_compiles_no_kernel_per_token(monkeypatch):
    """Each generated token is a new query offset and key length under transformers' mask function: the offsets
    are a tensor its mask_mod reads, so on the kernels (the simt backend) the decoding steps after the first
    compile nothing, and greedy generation gives sdpa's tokens."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from cuflash import api
    from cuflash.backends import simt
    ours, reference = transformers_pair(LlamaConfig, LlamaForCausalLM, vocab_size=97, hidden_size=64,
                                        intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, max_position_embeddings=64)
    ids = torch.randint(0, 97, (2, 9), generator=torch.Generator().manual_seed(7))
    attention_mask = torch.ones(2, 9, dtype=torch.long)
    attention_mask[1, :3] = 0  # left padding: every step's mask is a ModMask, not causal alone
    real = api.attention
    compiled = []  # (the call's query length, the kernels compiled so far), per attention call

    def on_the_kernels(*args, **kwargs):
        assert kwargs["mask_mod"] is not None
        before = set(simt._functions)
        result = real(*args, **dict(kwargs, backend="simt"))
        compiled.append((args[0].shape[-2], set(simt._functions) - before))
        return result
    monkeypatch.setattr(api, "attention", on_the_kernels)
    with torch.no_grad():
        tokens = ours.generate(ids, attention_mask=attention_mask, max_new_tokens=5, do_sample=False)
    decoding = [new for n, new in compiled if n == 1]
    assert len(decoding) == 2 * 4 and decoding[1:] == [set()] * 7  # 4 steps after the prompt, 2 layers each
    monkeypatch.setattr(api, "attention", real)
    with torch.no_grad():
        torch.testing.assert_close(tokens, reference.generate(ids, attention_mask=attention_mask, max_new_tokens=5,
                                                              do_sample=False))


def test_a_bert_encoder_with_a_padding_mask(calls):
    from transformers import BertConfig, BertModel
    ours, reference = transformers_pair(BertConfig, BertModel, vocab_size=97, hidden_size=64,
                                        intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                        max_position_embeddings=64, hidden_dropout_prob=0.0,
                                        attention_probs_dropout_prob=0.0)
    ids = torch.randint(0, 97, (3, 23), generator=torch.Generator().manual_seed(4))
    attention_mask = torch.ones(3, 23, dtype=torch.long)
    attention_mask[0, 15:] = 0  # right padding
    attention_mask[2, 9:] = 0
    keep = attention_mask.bool()
    states = [model(input_ids=ids, attention_mask=attention_mask).last_hidden_state[keep]
              for model in (ours, reference)]
    assert len(calls) == 2
    torch.testing.assert_close(states[0], states[1], rtol=1e-4, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="torch sees no CUDA device (a CPU build, or none)")
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_cuda_tensors_train_on_the_kernels(dtype):
    """CUDA tensors: forward and backward on the cupy backend's kernels, on torch's stream, results on the GPU;
    grouped-query heads by broadcasting get their group's gradient sum."""
    cpu = tensors([(2, 4, 70, 64), (2, 1, 90, 64), (2, 1, 90, 64)], dtype)
    q, k, v = (x.detach().cuda().requires_grad_() for x in cpu)
    out = ct.attention(q, k, v, causal=True)
    assert out.device == q.device and out.dtype == dtype
    dout = torch.randn_like(out)
    out.backward(dout)
    assert all(x.grad.device == q.device and x.grad.shape == x.shape for x in (q, k, v))
    grads = [as_numpy(x.grad.cpu()) for x in (q, k, v)]
    assert_grads_accurate(grads, as_numpy(dout.cpu()), *(as_numpy(x) for x in cpu), causal=True)


def transformers_pair_eager(config_cls, model_cls, **config):
    """As transformers_pair, against transformers' eager attention (the models sdpa does not serve: softcap)."""
    pytest.importorskip("transformers")
    name = ct.register_with_transformers()
    torch.manual_seed(0)
    reference = model_cls(config_cls(**config, attn_implementation="eager")).eval()
    ours = model_cls(config_cls(**config, attn_implementation="eager")).eval()
    ours.load_state_dict(reference.state_dict())
    ours.set_attn_implementation(name)
    return ours, reference


def run_and_compare(ours, reference, ids, attention_mask, calls, layers):
    """Logits of the unpadded tokens and every parameter's gradient, ours against the reference; then greedy
    generation with a cache."""
    keep = attention_mask.bool()
    results = []
    for model in (ours, reference):
        logits = model(input_ids=ids, attention_mask=attention_mask).logits
        (logits[keep] ** 2).mean().backward()
        results.append((logits[keep].detach(), [p.grad.clone() for p in model.parameters()]))
    assert len(calls) == layers
    torch.testing.assert_close(results[0][0], results[1][0], rtol=1e-4, atol=1e-5)
    for got, want in zip(results[0][1], results[1][1]):
        torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(ours.generate(ids[:1], max_new_tokens=4, do_sample=False),
                                   reference.generate(ids[:1], max_new_tokens=4, do_sample=False))


def test_a_gemma2_with_soft_capping_and_sliding_windows(calls):
    from transformers import Gemma2Config, Gemma2ForCausalLM
    ours, reference = transformers_pair_eager(
        Gemma2Config, Gemma2ForCausalLM, vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=6,
        attn_logit_softcapping=0.05, final_logit_softcapping=None, layer_types=["sliding_attention",
                                                                                 "full_attention"])
    ids = torch.randint(0, 97, (2, 21), generator=torch.Generator().manual_seed(5))
    attention_mask = torch.ones(2, 21, dtype=torch.long)
    attention_mask[1, :4] = 0  # left padding
    run_and_compare(ours, reference, ids, attention_mask, calls, layers=2)


def test_a_gpt_oss_with_sinks_and_sliding_windows(calls):
    from transformers import GptOssConfig, GptOssForCausalLM
    ours, reference = transformers_pair_eager(
        GptOssConfig, GptOssForCausalLM, vocab_size=97, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=5,
        num_local_experts=2, num_experts_per_tok=1, layer_types=["sliding_attention", "full_attention"])
    with torch.no_grad():
        for model in (ours, reference):
            for layer in model.model.layers:
                layer.self_attn.sinks.copy_(torch.linspace(-1, 1, 4))  # nonzero sinks: their gradient counts
    ids = torch.randint(0, 97, (2, 17), generator=torch.Generator().manual_seed(6))
    attention_mask = torch.ones(2, 17, dtype=torch.long)
    attention_mask[0, :3] = 0
    run_and_compare(ours, reference, ids, attention_mask, calls, layers=2)


def test_flex_attention_style_mods_and_sinks_train():
    """Mods written with torch over torch tensors, as for flex_attention, and learnable sinks: outputs and
    gradients against autograd of the dense formula; a learnable tensor inside a mod is refused, not ignored."""
    torch.manual_seed(0)
    b, h, n, d = 2, 4, 33, 8
    q, k, v = (torch.randn(b, h, n, d, dtype=torch.float64, requires_grad=True) for _ in range(3))
    sinks = torch.randn(h, dtype=torch.float64, requires_grad=True)
    table = torch.randn(h, 2 * n - 1, dtype=torch.float64)
    document = torch.tensor([0] * 16 + [1] * 17)

    def relative(score, b_, h_, q_idx, kv_idx):
        return torch.tanh((score + table[h_, q_idx - kv_idx + n - 1]) / 5) * 5

    def same_document_causal(b_, h_, q_idx, kv_idx):
        return (document[q_idx] == document[kv_idx]) & (q_idx >= kv_idx)

    out = ct.attention(q, k, v, score_mod=relative, mask_mod=same_document_causal, sinks=sinks)
    out.square().sum().backward()
    got = [x.grad.clone() for x in (q, k, v, sinks)]
    for x in (q, k, v, sinks):
        x.grad = None
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    scores = torch.tanh((q @ k.transpose(-1, -2) / d ** 0.5 + table[:, i - j + n - 1]) / 5) * 5
    scores = scores.masked_fill(~((document[:, None] == document[None, :]) & (i >= j)), -float("inf"))
    weights = torch.softmax(torch.cat([scores, sinks[None, :, None, None].expand(b, h, n, 1)], -1), -1)
    expected = weights[..., :n] @ v
    torch.testing.assert_close(out, expected)
    expected.square().sum().backward()
    for g, x in zip(got, (q, k, v, sinks)):
        torch.testing.assert_close(g, x.grad)
    # A learnable table: its gradient through the mod, as autograd's of the dense formula.
    table.requires_grad_(True)
    for x in (q, k, v):
        x.grad = None
    ct.attention(q, k, v, score_mod=relative, causal=True).square().sum().backward()
    got = [x.grad.clone() for x in (q, k, v, table)]
    for x in (q, k, v, table):
        x.grad = None
    scores = torch.tanh((q @ k.transpose(-1, -2) / d ** 0.5 + table[:, i - j + n - 1]) / 5) * 5
    (torch.softmax(scores.masked_fill(i < j, -float("inf")), -1) @ v).square().sum().backward()
    for g, x in zip(got, (q, k, v, table)):
        torch.testing.assert_close(g, x.grad)


# ----------------------------------------------------------------------------------------------------------------
# Packed sequences: cuflash.torch.attention_varlen, and transformers' packed batches


def packed_tensors(lengths, heads=(4, 2), d=8, dtype=torch.float64, seed=0):
    """(q, k, v, cu_seqlens) for sequences of these lengths (queries = keys), q (total, H, d), k and v (total, Hk,
    d), cu_seqlens an int32 tensor (as FlashAttention's users hold them)."""
    total = sum(lengths)
    q, k, v = tensors([(total, heads[0], d), (total, heads[1], d), (total, heads[1], d)], dtype, seed)
    return q, k, v, torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)


def per_sequence(q, k, v, cu, **options):
    """Each sequence alone through torch's own attention (grouped heads repeated; causal top-left, which is
    bottom-right when queries and keys are as many), concatenated back: the reference."""
    groups = q.shape[1] // k.shape[1]
    outs = []
    for s in range(len(cu) - 1):
        rows = slice(int(cu[s]), int(cu[s + 1]))
        one = [x[rows].transpose(0, 1) for x in (q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1))]
        outs.append(torch.nn.functional.scaled_dot_product_attention(*one, **options).transpose(0, 1))
    return torch.cat(outs)


def test_varlen_gradcheck_and_torch_compile():
    """attention_varlen is differentiable (gradcheck in float64, an empty sequence among them) and torch.compile
    traces its operators as opaque nodes."""
    q, k, v, cu = packed_tensors([3, 0, 5, 2])
    assert torch.autograd.gradcheck(lambda q, k, v: ct.attention_varlen(q, k, v, cu, cu, causal=True), (q, k, v))
    compiled = torch.compile(lambda q, k, v: ct.attention_varlen(q, k, v, cu, cu, causal=True),
                             backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(q, k, v), ct.attention_varlen(q, k, v, cu, cu, causal=True))


def test_a_packed_training_step_matches_each_sequence_alone():
    """Grouped-query heads over packed sequences, float32: outputs and gradients against torch's attention on each
    sequence alone; lse with return_lse; the offsets as a list work too."""
    q, k, v, cu = packed_tensors([7, 12, 1, 9], dtype=torch.float32, d=16)
    out, lse = ct.attention_varlen(q, k, v, cu, cu.tolist(), causal=True, return_lse=True)
    assert out.shape == (29, 4, 16) and lse.shape == (29, 4) and not lse.requires_grad
    dout = torch.randn_like(out)
    out.backward(dout)
    got = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    expected = per_sequence(q, k, v, cu, is_causal=True)
    expected.backward(dout)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    for g, x in zip(got, (q, k, v)):
        torch.testing.assert_close(g, x.grad, rtol=1e-4, atol=1e-5)


def test_varlen_mods_and_sinks_train():
    """A torch-written score_mod over (s, h, i, j) and learnable sinks on packed sequences: gradients by gradcheck;
    a score_mod closing over a tensor that requires grad is refused, not silently left without its gradient."""
    q, k, v, cu = packed_tensors([4, 6])
    sinks = torch.randn(4, dtype=torch.float64, requires_grad=True)
    slopes = torch.linspace(0.1, 0.4, 4, dtype=torch.float64)

    def alibi(score, s, h, i, j):
        return score - slopes[h] * torch.abs(i - j)
    assert torch.autograd.gradcheck(
        lambda q, k, v, sinks: ct.attention_varlen(q, k, v, cu, cu, score_mod=alibi, sinks=sinks, causal=True),
        (q, k, v, sinks))
    slopes.requires_grad_(True)
    with pytest.raises(ValueError, match="closes over tensors that require grad"):
        ct.attention_varlen(q, k, v, cu, cu, score_mod=alibi)


def test_varlen_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q, k = torch.empty(10, 4, 8, dtype=torch.float16), torch.empty(12, 2, 8, dtype=torch.float16)
        cu = torch.empty(3, dtype=torch.int32)
        out, lse = torch.ops.cuflash.attention_varlen_forward(q, k, k, cu, cu, None, None, None, False, None, None)
        assert out.shape == (10, 4, 8) and out.dtype == torch.float16 and lse.shape == (10, 4)


def packed_batch():
    """Two rows of three packed sequences each (position ids restarting), and their offsets over the flattened
    tokens."""
    lengths = [5, 9, 3]
    ids = torch.randint(0, 97, (2, sum(lengths)), generator=torch.Generator().manual_seed(3))
    position_ids = torch.cat([torch.arange(length) for length in lengths])[None]
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths * 2)]), dtype=torch.int32)
    return ids, position_ids, cu


@pytest.fixture
def varlen_calls(monkeypatch):
    count = []
    real = ct.attention_varlen

    def counted(*args, **kwargs):
        count.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(ct, "attention_varlen", counted)
    return count


@pytest.mark.parametrize("model", ["llama", "qwen2"])
def test_packed_training_batches_of_transformers_models(model, varlen_calls):
    """A packed batch (no padding, no cache: position ids restart within each row, as transformers' collators make
    them) runs through attention_varlen, each sequence within itself, told by the packing transformers' own mask
    function holds; and with FlashAttention's keywords (cu_seq_lens_q/k, max_length_q/k). Logits and every
    parameter's gradient against transformers' eager attention; with a cache (generation) nothing is packed."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    config, model_cls = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}[model]
    ours, reference = transformers_pair_eager(config, model_cls, vocab_size=97, hidden_size=64, intermediate_size=96,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                              max_position_embeddings=64)
    ids, position_ids, cu = packed_batch()
    flash = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=9, max_length_k=9)
    results = []
    for net, keywords in ((ours, {}), (ours, flash), (reference, {})):
        net.train().zero_grad()
        logits = net(input_ids=ids, position_ids=position_ids, use_cache=False, **keywords).logits
        (logits ** 2).mean().backward()
        results.append((logits.detach(), [p.grad.clone() for p in net.parameters()]))
    assert len(varlen_calls) == 4  # two layers, two calls of ours
    for logits, grads in results[:2]:
        torch.testing.assert_close(logits, results[2][0], rtol=1e-4, atol=1e-5)
        for got, want in zip(grads, results[2][1]):
            torch.testing.assert_close(got, want, rtol=1e-3, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(ours.eval()(input_ids=ids, position_ids=position_ids).logits,
                                   reference.eval()(input_ids=ids, position_ids=position_ids).logits,
                                   rtol=1e-4, atol=1e-5)
    assert len(varlen_calls) == 4
