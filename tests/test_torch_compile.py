"""torch tensors run through the custom ops torch.ops.attnkern.attention and
attention_backward: torch.compile(fullgraph=True) traces attnkern.attention,
attention_backward and sdpa with zero graph breaks, forward and backward, and gives
eager's result; the ops' fake implementations give the real outputs' shapes; under
CPU autocast the op computes as its policy says."""

import numpy as np
import pytest

import attnkern

torch = pytest.importorskip("torch")
import torch._dynamo  # noqa: E402


@pytest.fixture
def inputs():
    seed = np.random.SeedSequence().entropy
    print(f"seed {seed}")
    g = torch.Generator().manual_seed(seed % 2**63)
    q = torch.randn(2, 4, 12, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, 12, 16, generator=g, requires_grad=True) for _ in range(2))
    return q, k, v, torch.randn(2, 4, 12, 16, generator=g)


def run(fn, q, k, v, dout):
    for x in (q, k, v):
        x.grad = None
    out = fn(q, k, v)
    out.backward(dout)
    return out.detach(), [x.grad.clone() for x in (q, k, v)]


CALLS = {
    "plain": lambda q, k, v: attnkern.attention(q, k, v),
    "features": lambda q, k, v: attnkern.attention(q, k, v, causal="bottom_right", window=(5, 0),
                                                   key_lengths=torch.tensor([12, 9]), softcap=20.0, scale=0.3),
    "tunables": lambda q, k, v: attnkern.attention(q, k, v, causal=True, kernel="native.flash", block_q=8,
                                                   num_threads=1),
    "lse": lambda q, k, v: attnkern.attention(q, k, v, return_lse=True)[0] * 2,
    "sdpa": lambda q, k, v: attnkern.sdpa(q, k, v, is_causal=True, enable_gqa=True) + 1,
}


@pytest.mark.parametrize("name", list(CALLS))
def test_compile_fullgraph_no_graph_breaks_matches_eager(inputs, name):
    fn = CALLS[name]
    q, k, v, dout = inputs
    explained = torch._dynamo.explain(fn)(q, k, v)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    torch._dynamo.reset()
    eager, eager_grads = run(fn, q, k, v, dout)
    compiled, grads = run(torch.compile(fn, fullgraph=True, backend="aot_eager"), q, k, v, dout)
    assert torch.equal(compiled, eager)
    for a, b in zip(grads, eager_grads):
        assert torch.equal(a, b)


def test_compile_inductor_and_attention_backward(inputs):
    q, k, v, dout = inputs

    def fn(q, k, v, dout):
        out, lse = attnkern.attention(q, k, v, causal=True, return_lse=True)
        return attnkern.attention_backward(q, k, v, out, dout, lse, causal=True)

    with torch.no_grad():
        eager = fn(q, k, v, dout)
        compiled = torch.compile(fn, fullgraph=True)(q, k, v, dout)
    for a, b in zip(compiled, eager):
        assert torch.equal(a, b)
    assert [tuple(g.shape) for g in eager] == [tuple(x.shape) for x in (q, k, v)]


def test_fake_implementations_give_the_real_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    ops = torch.ops.attnkern
    args = ("bottom_right", None, "auto", -1, -1, None, None, None, None, 0.0, None, "")
    with FakeTensorMode():
        q, k, v = torch.empty(2, 4, 3, 8), torch.empty(2, 2, 5, 8), torch.empty(2, 2, 5, 6)
        out, lse = ops.attention(q, k, v, *args, True, True, False)
        dq, dk, dv = ops.attention_backward(q, k, v, out, out, lse, *args)
    assert out.shape == (2, 4, 3, 6) and lse.shape == (2, 4, 3)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


def test_errors_still_say_what_to_fix(inputs):
    q, k, v, _ = inputs
    with pytest.raises(ValueError, match="window's left side must be >= 0"):
        attnkern.attention(q, k, v, window=(-1, 0))
    with pytest.raises(TypeError, match="tunable block_q must be a number"):
        attnkern.attention(q, k, v, block_q=[8])
    with pytest.raises(ValueError, match="unknown kernel"):
        attnkern.attention(q, k, v, kernel="nope")


def test_cpu_autocast_bfloat16(inputs):
    """Under CPU autocast the op computes in bfloat16 as SDPA does, with or without grad
    (native.flash's backward takes bfloat16): the output is bfloat16, the backward runs in
    bfloat16 and autograd returns the gradients in the inputs' float32, close to the
    float32 ones; the same under torch.compile."""
    q, k, v, dout = inputs
    with torch.no_grad():
        want = attnkern.attention(q, k, v, causal=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            got = attnkern.attention(q, k, v, causal=True)
        bf16 = attnkern.attention(*(x.bfloat16() for x in (q, k, v)), causal=True)
    assert got.dtype == torch.bfloat16 and torch.equal(got, bf16)
    torch.testing.assert_close(got.float(), want, atol=3e-2, rtol=3e-2)

    fn = lambda q, k, v: attnkern.attention(q, k, v, causal=True)  # noqa: E731
    dout = dout.bfloat16()  # the gradient of a bfloat16 output is bfloat16
    _, float_grads = run(fn, q, k, v, dout.float())
    half_out, half_grads = run(fn, *(x.detach().bfloat16().requires_grad_() for x in (q, k, v)), dout)

    def autocast_fn(q, k, v):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return fn(q, k, v)

    with torch.autocast("cpu", dtype=torch.bfloat16):  # float64 is not cast, as autocast leaves it
        assert attnkern.attention(*(x.detach().double() for x in (q, k, v))).dtype == torch.float64
    for f in (autocast_fn, torch.compile(autocast_fn, fullgraph=True, backend="aot_eager")):
        out, grads = run(f, q, k, v, dout)
        assert out.dtype == torch.bfloat16 and torch.equal(out, half_out)
        for a, h, w in zip(grads, half_grads, float_grads):
            assert a.dtype == torch.float32 and torch.equal(a, h.float())
            torch.testing.assert_close(a, w, atol=5e-2, rtol=5e-2)


def test_first_call_under_compile_defines_the_ops():
    """attnkern imported before torch, and its first call on tensors inside torch.compile:
    the ops are defined while tracing, with no graph break (a fresh process)."""
    import subprocess
    import sys

    script = """
import attnkern, torch, torch._dynamo
q, k, v = (torch.randn(1, 2, 8, 16, requires_grad=True) for _ in range(3))
fn = lambda q, k, v: attnkern.attention(q, k, v, causal=True)
explained = torch._dynamo.explain(fn)(q, k, v)
assert explained.graph_count == 1 and explained.graph_break_count == 0, explained.break_reasons
torch._dynamo.reset()
torch.compile(fn, fullgraph=True, backend="aot_eager")(q, k, v).sum().backward()
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == "ok", done.stderr[-3000:]


@pytest.mark.skipif("attn_mask" not in __import__("inspect").signature(attnkern.attention).parameters,
                    reason="attnkern.attention has no attn_mask / dropout_p yet")
def test_compile_sdpa_with_a_mask_and_dropout(inputs):
    """A boolean mask and dropout under torch.compile(fullgraph=True): no graph break, a fresh
    seed from torch's generator each call (the same as eager's after torch.manual_seed)."""
    q, k, v, dout = inputs
    mask = torch.rand(2, 1, 12, 12) < 0.8

    def fn(q, k, v):
        return attnkern.sdpa(q, k, v, attn_mask=mask, dropout_p=0.2, enable_gqa=True)

    explained = torch._dynamo.explain(fn)(q, k, v)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    torch._dynamo.reset()
    compiled_fn = torch.compile(fn, fullgraph=True, backend="aot_eager")
    torch.manual_seed(5)
    eager, eager_grads = run(fn, q, k, v, dout)
    torch.manual_seed(5)
    compiled, grads = run(compiled_fn, q, k, v, dout)
    assert torch.equal(compiled, eager)
    for a, b in zip(grads, eager_grads):
        assert torch.equal(a, b)
    assert not torch.equal(compiled_fn(q, k, v), compiled)  # a new seed each call
