"""cuda.flash under torch autograd on CUDA tensors with check_finite=False: the forward and
the backward queue their kernels without waiting for the GPU (no device synchronisation),
so that a training step's CPU runs ahead of its GPU as it does with torch SDPA. A long GPU
busy-wait is queued first; after forward and backward the GPU must still be busy. Then the
results against the float64 reference (FlashAttention's rule for the gradients), bit for
bit equal to the general path's and the custom op's; check_finite=True still raises on a
NaN. Needs a GPU (ATTNKERN_TEST_GPU=1 on the GPU host); skipped elsewhere."""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (run with ATTNKERN_TEST_GPU=1 on the GPU host)", allow_module_level=True)

import attnkern  # noqa: E402
from attnkern import _torch_cuda  # noqa: E402
from attnkern.backends import cuda as cuda_backend  # noqa: E402
from conftest import require_cuda_kernels  # noqa: E402

require_cuda_kernels()
from test_triton import check, check_gradients  # noqa: E402

SLEEP_CYCLES = 2_000_000_000  # about a second of GPU clock cycles (H100, H200: up to about 2 GHz)


def _leaves(dtype, shape, kv_heads, seed):
    """q, k, v leaves that require grad (k and v with kv_heads heads) and dout, on the GPU."""
    g = torch.Generator().manual_seed(seed)
    b, h, n, d = shape
    make = lambda heads: torch.randn(b, heads, n, d, generator=g).to(dtype).cuda()  # noqa: E731
    q, k, v = make(h).requires_grad_(), make(kv_heads).requires_grad_(), make(kv_heads).requires_grad_()
    return q, k, v, make(h)


def _step(q, k, v, dout, causal, check_finite=False):
    """Forward and backward through autograd: out and (dq, dk, dv)."""
    for x in (q, k, v):
        x.grad = None
    out = attnkern.attention(q, k, v, causal=causal, check_finite=check_finite)
    out.backward(dout)
    return out.detach(), (q.grad, k.grad, v.grad)


@pytest.fixture(params=["eager", "op"])
def autograd_path(request):
    """Both ways autograd reaches cuda.flash: the eager autograd Function and the custom op."""
    was = cuda_backend.EAGER_AUTOGRAD
    cuda_backend.EAGER_AUTOGRAD = request.param == "eager"
    yield request.param
    cuda_backend.EAGER_AUTOGRAD = was


@pytest.mark.parametrize("dtype, shape, causal", [
    (torch.bfloat16, (8, 8, 1024, 64), "bottom_right"),  # the training step's call (GQA 8 over 2)
    (torch.bfloat16, (2, 8, 300, 64), True),
    (torch.float16, (2, 4, 257, 128), False),
    (torch.float32, (2, 8, 200, 64), "bottom_right"),  # 3xTF32 forward and backward
])
def test_autograd_calls_do_not_wait_for_the_gpu(autograd_path, dtype, shape, causal):
    q, k, v, dout = _leaves(dtype, shape, 2, seed=shape[2])
    for _ in range(3):  # the first call of a shape plans it (and compiles); the next ones use the plan
        want = _step(q, k, v, dout, causal)
    torch.cuda.synchronize()
    torch.cuda._sleep(SLEEP_CYCLES)
    got = _step(q, k, v, dout, causal)
    busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert busy, "forward or backward waited for the GPU"
    assert torch.equal(got[0], want[0]) and all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    scale = shape[3] ** -0.5
    check(got[0], None, q.detach(), k.detach(), v.detach(), causal, scale, "cuda.flash", (dtype, shape))
    check_gradients(got[1], q.detach(), k.detach(), v.detach(), dout, causal, scale, {}, (dtype, shape))


def test_prepared_calls_match_the_general_path_bit_for_bit(autograd_path):
    """Forward and backward with the prepared launches (and attention_backward's plan) against
    the general path (the fast path off): the same bits, GQA and both causal alignments."""
    for dtype, causal in ((torch.bfloat16, "bottom_right"), (torch.float16, True), (torch.float32, False)):
        q, k, v, dout = _leaves(dtype, (2, 8, 333, 64), 2, seed=7)
        fast = [_step(q, k, v, dout, causal) for _ in range(3)][-1]
        _torch_cuda.FAST_PATH = False
        try:
            general = _step(q, k, v, dout, causal)
        finally:
            _torch_cuda.FAST_PATH = True
        assert torch.equal(fast[0], general[0])
        assert all(torch.equal(a, b) for a, b in zip(fast[1], general[1])), (dtype, causal)
        out, lse = attnkern.attention(q.detach(), k.detach(), v.detach(), causal=causal, return_lse=True)
        for _ in range(3):
            grads = attnkern.attention_backward(q.detach(), k.detach(), v.detach(), out, dout, lse, causal=causal)
        assert all(torch.equal(a, b) for a, b in zip(grads, general[1]))
    plans = [p for p in _torch_cuda._plans("backward_plans").values() if p.launch is not None]
    assert len(plans) >= 3, "attention_backward did not take the prepared backward"


def test_planned_differentiable_calls_run_their_plan_at_once(monkeypatch):
    """A differentiable call of a planned shape runs its plan from attention()'s first step
    (the eager autograd function given the plan), past the general path's checks, and its
    backward gets no zeros for the lse's gradient (no fill kernel): the same bits as before;
    in a bfloat16 autocast region too, for bfloat16 inputs (with and without grad)."""
    monkeypatch.setattr(_torch_cuda, "RECHECK_S", 3600.0)  # the plans made below stay while the test runs
    q, k, v, dout = _leaves(torch.bfloat16, (2, 8, 256, 64), 2, seed=5)
    for _ in range(3):
        want = _step(q, k, v, dout, True)
        plain = attnkern.attention(q.detach(), k.detach(), v.detach(), causal=True, check_finite=False)

    def refuse(*args, **kwargs):
        raise AssertionError("the general path ran")

    monkeypatch.setattr(attnkern._api, "_torch_attention", refuse)
    monkeypatch.setattr(attnkern._api, "_run_torch", refuse)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        got = _step(q, k, v, dout, True)
    assert torch.equal(got[0], want[0]) and all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    filled = [e.name for e in prof.events() if e.name in ("aten::zeros", "aten::zero_", "aten::fill_")]
    assert not filled, f"the step filled memory: {filled}"
    with torch.autocast("cuda", dtype=torch.bfloat16):  # inputs of the region's dtype: as outside it
        got = _step(q, k, v, dout, True)
        assert torch.equal(attnkern.attention(q.detach(), k.detach(), v.detach(), causal=True,
                                              check_finite=False), plain)
    assert torch.equal(got[0], want[0]) and all(torch.equal(a, b) for a, b in zip(got[1], want[1]))
    # the backward's plan was found through the forward's (no lookup of its own)
    assert any(p.backward is not None for p in _torch_cuda._plans().values())


def test_check_finite_still_raises_under_autograd(autograd_path):
    """check_finite=True (its scan waits for the GPU) names the input with a NaN, on a
    planned call shape too."""
    q, k, v, dout = _leaves(torch.bfloat16, (2, 8, 128, 64), 2, seed=3)
    for _ in range(3):
        _step(q, k, v, dout, "bottom_right", check_finite=True)
    with torch.no_grad():
        k[1, 1, 5, 7] = float("nan")
    with pytest.raises(ValueError, match="^k contains NaN or infinity"):
        attnkern.attention(q, k, v, causal="bottom_right", check_finite=True)
    out = attnkern.attention(q, k, v, causal="bottom_right", check_finite=False)  # unchecked: it runs
    assert torch.isnan(out.detach()).any()


def test_eager_autograd_under_autocast_matches_the_op():
    """Under bf16 autocast, the eager autograd path casts float32 inputs as the op's policy
    does: the same output and gradients (float32 leaves get float32 gradients)."""
    q, k, v, dout = _leaves(torch.float32, (2, 8, 200, 64), 2, seed=11)
    results = []
    for eager in (True, False):
        cuda_backend.EAGER_AUTOGRAD = eager
        try:
            for x in (q, k, v):
                x.grad = None
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = attnkern.attention(q, k, v, causal=True, check_finite=False)
            assert out.dtype == torch.bfloat16
            out.backward(dout.to(torch.bfloat16))
            results.append([out.detach(), *(x.grad for x in (q, k, v))])
        finally:
            cuda_backend.EAGER_AUTOGRAD = True
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(*results))
    assert results[0][1].dtype == torch.float32
    assert np.isfinite(results[0][1].cpu().numpy()).all()
