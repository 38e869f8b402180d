"""The training path: log-sum-exp out, the flash backward, torch tensors in and out
with autograd. Gradients are checked against the exact float64 gradient of
attention (attnkern_bench.accuracy.reference_backward derives it from the math;
tests/test_cuda_backward.py checks it against torch's autograd).

Tolerances: max |grad - ref| <= tolerance(dtype) * max(1, max|ref|) * kappa, the
forward's bound (attnkern_bench.accuracy derives it; the gradients have its
budget: the backward recomputes P from the saved lse, one more rounding per
score, and sums N or D products per element); the log-sum-exp row by row within
lse_tolerance(dtype)."""

import numpy as np
import pytest
import torch

import attnkern
from attnkern import _registry
from attnkern_bench.accuracy import (
    gradient_error,
    lse_error,
    lse_tolerance,
    reference_backward,
    reference_lse,
    tolerance,
)
from conftest import ISAS, forced_isa, max_threads, random_qkv

LSE_KERNELS = [k for k in attnkern.kernels() if attnkern.kernel_info(k)["returns_lse"]
               and attnkern.kernel_info(k)["available"] and not k.startswith("cuda.")]
SHAPES = [((2, 3), 37, 29, 8, 5), ((1,), 13, 40, 5, 3), ((), 64, 64, 16, 16), ((2,), 100, 70, 33, 17)]


def exact(q, k, v, dout, causal, scale=None):
    """out, lse and (dq, dk, dv) in float64."""
    return (attnkern.reference(q, k, v, causal=causal, scale=scale), reference_lse(q, k, causal=causal, scale=scale),
            reference_backward(q, k, v, dout, causal=causal, scale=scale))


def assert_close(got, ref, q, k, dtype, what=""):
    err = gradient_error(got, ref, q, k)
    assert err <= tolerance(dtype), f"{what}: scaled error {err:.3g} > {tolerance(dtype):.3g}"


@pytest.mark.parametrize("kernel", LSE_KERNELS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True])
def test_lse_matches_the_reference(kernel, dtype, causal):
    rng = np.random.default_rng(0)
    for lead, nq, nk, d, dv in SHAPES:
        q, k, v = random_qkv(rng, lead, nq, nk, d, dv, dtype)
        out, lse = attnkern.attention(q, k, v, causal=causal, kernel=kernel, return_lse=True)
        ref_out, ref_lse, _ = exact(q, k, v, np.zeros_like(np.asarray(out)), causal)
        assert lse.shape == out.shape[:-1] and lse.dtype == out.dtype
        assert_close(out, ref_out, q, k, dtype, what="out")
        err = lse_error(lse, ref_lse)
        assert err <= lse_tolerance(dtype), f"lse: error {err:.3g} > {lse_tolerance(dtype):.3g}"


def test_kernels_without_lse_or_backward_say_which_have_them():
    q, k, v = random_qkv(0, (), 8, 8, 4)
    with pytest.raises(ValueError, match=r"torch.naive cannot return the log-sum-exp; kernels that can: .*native.flash"):
        attnkern.attention(q, k, v, kernel="torch.naive", return_lse=True)
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    with pytest.raises(ValueError, match=r"native.tiled has no backward pass.*differentiable kernels: native.flash"):
        attnkern.attention(tq, tk, tv, kernel="native.tiled")
    with torch.no_grad():  # no graph: any kernel
        assert isinstance(attnkern.attention(tq, tk, tv, kernel="native.tiled"), torch.Tensor)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("causal", [False, True])
def test_flash_backward_matches_the_exact_gradient(isa, dtype, causal):
    rng = np.random.default_rng(1)
    blocks = [(8, 16), (4, 8), (256, 256), (32, 8)]
    with forced_isa(isa):
        for (lead, nq, nk, d, dv), (bq, bk) in zip(SHAPES, blocks):
            q, k, v = random_qkv(rng, lead, nq, nk, d, dv, dtype)
            dout = rng.standard_normal((*lead, nq, dv)).astype(dtype)
            tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
            out = attnkern.attention(tq, tk, tv, causal=causal, kernel="native.flash", block_q=bq, block_k=bk)
            assert isinstance(out, torch.Tensor) and out.dtype == tq.dtype and out.requires_grad
            out.backward(torch.tensor(dout))
            ref_out, _, grads = exact(q, k, v, dout, causal)
            assert_close(out.detach().numpy(), ref_out, q, k, dtype, what="out")
            for name, t, ref in zip(("dq", "dk", "dv"), (tq, tk, tv), grads):
                assert t.grad.shape == t.shape
                assert_close(t.grad.numpy(), ref, q, k, dtype, what=f"{name} {(nq, nk, d, dv)}")


def test_backward_with_nq_past_nk_and_rows_that_see_few_keys():
    """Causal with nq > nk: the last rows see every key; with nq < nk most keys are
    seen by no query, so their dk and dv are exactly zero."""
    rng = np.random.default_rng(3)
    for nq, nk in ((20, 7), (5, 30)):
        q, k, v = random_qkv(rng, (2,), nq, nk, 6, 4, np.float64)
        dout = rng.standard_normal((2, nq, 4))
        _, _, grads = exact(q, k, v, dout, True)
        tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
        attnkern.attention(tq, tk, tv, causal=True, kernel="native.flash", block_q=4, block_k=3).backward(
            torch.tensor(dout))
        for t, ref in zip((tq, tk, tv), grads):
            assert_close(t.grad.numpy(), ref, q, k, np.float64, what=f"{nq}x{nk}")
        if nq < nk:
            assert not tk.grad[:, nq:].any() and not tv.grad[:, nq:].any()


@pytest.mark.parametrize("isa", ISAS)
def test_backward_is_bit_identical_for_every_thread_count(isa):
    rng = np.random.default_rng(4)
    q, k, v = random_qkv(rng, (2, 3), 203, 181, 40, 24, np.float32)
    dout = rng.standard_normal((2, 3, 203, 24)).astype(np.float32)
    kernel = _registry.get("native.flash")
    results = []
    with forced_isa(isa):
        for threads in range(1, max_threads("native.flash") + 1 if max_threads("native.flash") < 5 else 5):
            params = dict(block_q=32, block_k=64, num_threads=threads)
            q3, k3, v3, do3 = (x.reshape(6, x.shape[-2], x.shape[-1]) for x in (q, k, v, dout))
            lse = np.empty((6, 203), np.float32)
            out = kernel.run(q3, k3, v3, True, 0.125, lse=lse, **params)
            results.append((out, lse, *kernel.backward(q3, k3, v3, out, do3, lse, True, 0.125, **params)))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert np.array_equal(a, b)


def test_gradcheck_in_float64():
    rng = np.random.default_rng(5)
    for causal in (False, True):
        q, k, v = (torch.tensor(x, requires_grad=True) for x in random_qkv(rng, (2,), 9, 7, 4, 3, np.float64))
        assert torch.autograd.gradcheck(
            lambda a, b, c: attnkern.attention(a, b, c, causal=causal, kernel="native.flash", block_q=4, block_k=3),
            (q, k, v))


def test_torch_in_torch_out_without_copies():
    q, k, v = (torch.from_numpy(x) for x in random_qkv(6, (2, 4), 33, 33, 16))
    out = attnkern.attention(q, k, v, causal=True)
    assert isinstance(out, torch.Tensor) and out.device == q.device and out.dtype == q.dtype
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert torch.allclose(out, ref, atol=1e-5)
    out, lse = attnkern.attention(q, k, v, return_lse=True)
    assert isinstance(lse, torch.Tensor) and lse.shape == (2, 4, 33)
    # a C-contiguous CPU tensor is read in place: a change to it shows in the next call
    before = attnkern.attention(q, k, v)
    v[..., 0, :] += 1
    assert not torch.equal(before, attnkern.attention(q, k, v))
    with pytest.raises(TypeError, match="must all be torch tensors or none"):
        attnkern.attention(q, k.numpy(), v)
    with pytest.raises(TypeError, match="dtype torch.int32; attnkern supports float32, float64, float16"):
        attnkern.attention(q.int(), k.int(), v.int())
    with pytest.raises(TypeError, match="numpy.naive does not take float16 inputs"):
        attnkern.attention(q.half(), k.half(), v.half(), kernel="numpy.naive")


def test_non_contiguous_tensors_and_grad_of_one_input():
    rng = np.random.default_rng(7)
    q, k, v = random_qkv(rng, (3,), 12, 12, 8, 8, np.float64)
    tq = torch.tensor(q).transpose(0, 1).requires_grad_()  # (12, 3, 8), a non-contiguous view inside
    tk, tv = torch.tensor(k), torch.tensor(v)
    out = attnkern.attention(tq.transpose(0, 1), tk, tv, kernel="native.flash")
    out.sum().backward()
    _, _, grads = exact(q, k, v, np.ones((3, 12, 8)), False)
    assert_close(tq.grad.transpose(0, 1).numpy(), grads[0], q, k, np.float64, what="dq")
    assert tk.grad is None


def _train(attention, steps, seed=0):
    """A tiny pre-norm transformer block on a copy task; returns the loss per step."""
    torch.manual_seed(seed)
    vocab, dim, heads, seq, batch = 16, 32, 4, 12, 8
    emb = torch.nn.Embedding(vocab, dim)
    qkv = torch.nn.Linear(dim, 3 * dim)
    proj = torch.nn.Linear(dim, dim)
    mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))
    norm1, norm2, head = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim), torch.nn.Linear(dim, vocab)
    params = [p for m in (emb, qkv, proj, mlp, norm1, norm2, head) for p in m.parameters()]
    opt = torch.optim.Adam(params, lr=3e-3)
    data = torch.Generator().manual_seed(seed + 1)
    losses = []
    for _ in range(steps):
        x = torch.randint(0, vocab, (batch, seq), generator=data)
        h = emb(x)
        a = qkv(norm1(h)).view(batch, seq, 3, heads, dim // heads).permute(2, 0, 3, 1, 4)
        h = h + proj(attention(a[0], a[1], a[2]).transpose(1, 2).reshape(batch, seq, dim))
        h = h + mlp(norm2(h))
        logits = head(h)[:, :-1]
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), x[:, :-1].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return np.array(losses)


def test_a_transformer_block_trains_as_with_torch_sdpa():
    """Same seed, same data: the loss curve with attnkern's attention follows torch's
    SDPA's step for step over 200 steps of Adam (float32 rounding differs; the curves
    agree to about 2e-7 of the first loss), and the block learns (the loss falls)."""
    steps = 200
    ours = _train(lambda q, k, v: attnkern.attention(q, k, v, causal=True, kernel="native.flash"), steps)
    theirs = _train(lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), steps)
    assert np.abs(ours - theirs).max() <= 1e-5 * theirs[0]
    assert ours[-20:].mean() < 0.1 * ours[:20].mean()


def test_attention_backward_equals_autograd_and_checks_its_arguments():
    """attention_backward (NumPy and torch) gives what autograd through attention()
    gives, bit for bit, and names a wrong out/dout/lse."""
    q, k, v = random_qkv(7, (2, 3), 40, 40, 16)
    out, lse = attnkern.attention(q, k, v, causal=True, return_lse=True)
    dout = np.random.default_rng(8).standard_normal(out.shape).astype(np.float32)
    grads = attnkern.attention_backward(q, k, v, out, dout, lse, causal=True)
    tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
    attnkern.attention(tq, tk, tv, causal=True).backward(torch.tensor(dout))
    for g, t in zip(grads, (tq, tk, tv)):
        assert g.shape == t.shape and np.array_equal(g, t.grad.numpy())
    tgrads = attnkern.attention_backward(*(torch.tensor(x) for x in (q, k, v, out, dout, lse)), causal=True)
    for g, t in zip(grads, tgrads):
        assert np.array_equal(g, t.numpy())
    with pytest.raises(ValueError, match=r"lse has shape \(2, 3, 39\); expected \(2, 3, 40\)"):
        attnkern.attention_backward(q, k, v, out, dout, lse[..., 1:], causal=True)
    with pytest.raises(TypeError, match="dout has dtype float64; expected float32"):
        attnkern.attention_backward(q, k, v, out, dout.astype(np.float64), lse, causal=True)
    with pytest.raises(ValueError, match="torch.sdpa has no backward pass"):
        attnkern.attention_backward(q, k, v, out, dout, lse, kernel="torch.sdpa")
