"""Bit-identical results run after run and for every thread count; safe under
concurrent calls from Python threads (the GIL is released in native code)."""

import threading

import numpy as np
import pytest

import attnkern
from conftest import CPU_TUNABLE, TUNABLE, assert_matches_reference, forced_isa, max_threads, random_qkv


@pytest.mark.parametrize("kernel, isa", TUNABLE)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_bitwise_identical_across_runs_and_threads(kernel, isa, causal, dtype):
    rng = np.random.default_rng(11)
    q, k, v = random_qkv(rng, (2, 3), 203, 181, 40, 24, dtype)
    with forced_isa(isa):
        first = attnkern.attention(q, k, v, causal=causal, kernel=kernel, num_threads=1)
        for threads in [t for t in (1, 2, 3, 4, 7) if t <= max_threads(kernel)]:
            for _ in range(2):
                out = attnkern.attention(q, k, v, causal=causal, kernel=kernel, num_threads=threads)
                assert out.tobytes() == first.tobytes(), f"num_threads={threads} changed the result"


@pytest.mark.parametrize("kernel", CPU_TUNABLE)
def test_concurrent_python_threads(kernel):
    rng = np.random.default_rng(12)
    problems = [random_qkv(rng, (2,), 120 + i, 90 + 2 * i, 32, 16, np.float32) for i in range(6)]
    expected = [attnkern.attention(*p, kernel=kernel, num_threads=1) for p in problems]
    results, errors = {}, []

    def work(i):
        try:
            for _ in range(5):
                out = attnkern.attention(*problems[i], kernel=kernel, num_threads=2)
                assert out.tobytes() == expected[i].tobytes()
            results[i] = out
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(problems))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert sorted(results) == list(range(len(problems)))
    for i, (q, k, v) in enumerate(problems):
        assert_matches_reference(results[i], q, k, v)


@pytest.mark.parametrize("isa", attnkern.supported_isas())
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_native_flash_rows_do_not_depend_on_block_q(isa, causal, dtype):
    # native.flash computes every row in an order fixed by block_k alone: the query block
    # (and the strips it is walked in) only groups rows, so block_q cannot change a bit.
    # d = 40 leaves a tail after the 16 x 16 transposes that pack Kt; nk = 181 a partial panel.
    rng = np.random.default_rng(13)
    q, k, v = random_qkv(rng, (2,), 203, 181, 40, 24, dtype)
    with forced_isa(isa):
        first = attnkern.attention(q, k, v, causal=causal, kernel="native.flash", block_q=203, block_k=64)
        for block_q in (1, 7, 64, 100):
            out = attnkern.attention(q, k, v, causal=causal, kernel="native.flash", block_q=block_q, block_k=64)
            assert out.tobytes() == first.tobytes(), f"block_q={block_q} changed the result"


@pytest.mark.parametrize("isa", sorted({"generic", attnkern.active_isa()}))
def test_backward_key_blocks_no_query_sees(isa):
    """Under a top-left causal mask with more keys than queries, the last key block
    (keys 12-13 of 14, block_k 6) is seen by no query: it must add nothing to dq and
    leave zero dk, dv. Its task once ran the last query block anyway with K left
    unpacked, so a thread whose first task it was multiplied dS = 0 by its fresh
    workspace: NaN in dq about once in a thousand calls at 6-16 threads. Many thread
    counts and repeats here, every result bit-identical to one thread's."""
    rng = np.random.default_rng(0)
    q = rng.standard_normal((2, 4, 11, 8)).astype(np.float32)
    k, v = (rng.standard_normal((2, 2, 14, d)).astype(np.float32) for d in (8, 6))
    dout = rng.standard_normal((2, 4, 11, 6)).astype(np.float32)
    kw = dict(kernel="native.flash", causal=True, block_q=4, block_k=6)
    with forced_isa(isa):
        out, lse = attnkern.attention(q, k, v, return_lse=True, num_threads=1, **kw)
        want = attnkern.attention_backward(q, k, v, out, dout, lse, num_threads=1, **kw)
        assert not want[1][..., 11:, :].any() and not want[2][..., 11:, :].any()  # keys no query sees
        for _ in range(40):
            for threads in range(2, 17):
                got = attnkern.attention_backward(q, k, v, out, dout, lse, num_threads=threads, **kw)
                for name, a, b in zip(("dq", "dk", "dv"), got, want):
                    assert a.tobytes() == b.tobytes(), f"{name} differs at {threads} threads"
