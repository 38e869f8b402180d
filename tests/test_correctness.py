"""Every available kernel against the float64 reference on fresh random inputs,
within the bound of attnkern_bench.accuracy (its docstring derives it: 2^7 unit
roundoffs of the dtype, scaled by max(1, max|v|) and the conditioning kappa;
float32 7.6e-6, float64 1.4e-14)."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import attnkern
from attnkern_bench.accuracy import conditioning, tolerance
from conftest import AVAILABLE, CPU_TUNABLE, TUNABLE, assert_matches_reference, forced_isa, max_threads, random_qkv


@st.composite
def problems(draw, max_n=300, max_d=256):
    return dict(
        lead=draw(st.sampled_from([(), (3,), (1, 2), (2, 3)])),
        nq=draw(st.integers(1, max_n)),
        nk=draw(st.integers(1, max_n)),
        d=draw(st.integers(1, max_d)),
        dv=draw(st.integers(1, max_d)),
        dtype=draw(st.sampled_from([np.float32, np.float64])),
        causal=draw(st.booleans()),
        scale=draw(st.one_of(st.none(), st.floats(-1.0, 1.0))),
        seed=draw(st.integers(0, 2**32 - 1)),
    )


def _inputs(p):
    rng = np.random.default_rng(p["seed"])
    return random_qkv(rng, p["lead"], p["nq"], p["nk"], p["d"], p["dv"], p["dtype"])


@pytest.mark.parametrize("kernel", AVAILABLE)
@given(p=problems())
def test_kernel_matches_reference(kernel, p):
    q, k, v = _inputs(p)
    out = attnkern.attention(q, k, v, causal=p["causal"], scale=p["scale"], kernel=kernel)
    assert_matches_reference(out, q, k, v, p["causal"], p["scale"])


@pytest.mark.parametrize("kernel, isa", TUNABLE)
@given(p=problems(), data=st.data())
def test_every_isa_and_tunables(kernel, isa, p, data):
    """The portable fallback and each vector path, with random valid tunables."""
    info = attnkern.kernel_info(kernel)["params"]
    params = {"num_threads": data.draw(st.integers(1, min(4, max_threads(kernel))), label="num_threads")}
    if "block_q" in info:
        params["block_q"] = data.draw(st.integers(1, 160), label="block_q")
        params["block_k"] = data.draw(st.integers(1, 320), label="block_k")
    q, k, v = _inputs(p)
    with forced_isa(isa):
        out = attnkern.attention(q, k, v, causal=p["causal"], scale=p["scale"], kernel=kernel, **params)
    assert_matches_reference(out, q, k, v, p["causal"], p["scale"])


@pytest.mark.parametrize("kernel, isa", TUNABLE)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_block_edges(kernel, isa, dtype):
    """Sizes one off the register tile and vector widths, blocks of 1 and larger than N."""
    rng = np.random.default_rng(7)
    tunables = attnkern.kernel_info(kernel)["params"]
    for n, d in [(1, 1), (5, 3), (6, 8), (7, 9), (15, 16), (16, 17), (17, 33), (33, 64), (97, 65)]:
        for bq, bk in [(1, 1), (6, 16), (7, 15), (64, 256), (1024, 4096)]:
            params = {"block_q": bq, "block_k": bk} if "block_q" in tunables else {}
            for causal in (False, True):
                q, k, v = random_qkv(rng, (2,), n, n + 3, d, d + 1, dtype)
                with forced_isa(isa):
                    out = attnkern.attention(q, k, v, causal=causal, kernel=kernel, **params)
                assert_matches_reference(out, q, k, v, causal)


@pytest.mark.parametrize("kernel", AVAILABLE)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_huge_scores_stay_finite_and_correct(kernel, dtype):
    """Scores of magnitude 1e4: exp without a running max would overflow."""
    rng = np.random.default_rng(1)
    n, d = 150, 16
    q = np.zeros((2, n, d))
    k = np.zeros((2, n, d))
    q[..., 0] = 100.0
    k[..., 0] = 100.0 + rng.permutation(n) * 0.5  # scores 1e4 .. 1.4e4, 50 apart after scale 1
    v = rng.standard_normal((2, n, d))
    q, k, v = (x.astype(dtype) for x in (q, k, v))
    for causal in (False, True):
        out = attnkern.attention(q, k, v, causal=causal, scale=1.0, kernel=kernel)
        assert np.isfinite(out).all()
        ref = attnkern.reference(q, k, v, causal=causal, scale=1.0)
        # the softmax is one-hot: every output row is the v row of the largest visible score.
        # kappa (about 4e3 here) would make the usual bound vacuous; a one-hot softmax does
        # not amplify the scores' rounding (the gaps of 50 dwarf it), so the bound holds
        # without it
        np.testing.assert_allclose(out, ref, rtol=0, atol=tolerance(dtype) * max(1.0, np.abs(v).max()))


@pytest.mark.parametrize("kernel", AVAILABLE)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_lone_key_gets_probability_exactly_one(kernel, dtype):
    """The largest score's probability is 2^0 = 1 exactly: a row with one key returns that
    key's v row bit for bit (and a score of 0 an lse of 0), even where v holds the dtype's largest finite
    values (a 2^0 one unit above 1, as the float32 polynomial once gave, overflowed there
    and put 1.2e-7 in the lse of a score of 0)."""
    big = np.finfo(dtype).max
    rng = np.random.default_rng(2)
    q = rng.standard_normal((2, 3, 16)).astype(dtype)
    k = rng.standard_normal((2, 1, 16)).astype(dtype)
    v = rng.standard_normal((2, 1, 24)).astype(dtype)
    v[0, 0, :4] = [big, -big, big / 3, 1.0]
    out = attnkern.attention(q, k, v, kernel=kernel)
    np.testing.assert_array_equal(np.asarray(out), np.broadcast_to(v, (2, 3, 24)))
    if attnkern.kernel_info(kernel)["returns_lse"]:  # a lone score of 0: log(2^0) = 0
        _, lse = attnkern.attention(q * 0, k, v, kernel=kernel, return_lse=True)
        np.testing.assert_array_equal(np.asarray(lse, np.float64), 0.0)


@pytest.mark.parametrize("kernel", CPU_TUNABLE)
def test_causal_matches_torch_top_left(kernel):
    rng = np.random.default_rng(2)
    for nq, nk in [(37, 37), (20, 53), (53, 20)]:
        q, k, v = random_qkv(rng, (2, 3), nq, nk, 24, 12, np.float64)
        expected = torch.nn.functional.scaled_dot_product_attention(
            torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v), is_causal=True
        ).numpy()
        out = attnkern.attention(q, k, v, causal=True, kernel=kernel)
        # both within the float64 bound of the exact result (against the reference elsewhere)
        bound = 2 * tolerance(np.float64) * max(1.0, np.abs(v).max()) * conditioning(q, k)
        np.testing.assert_allclose(out, expected, rtol=0, atol=bound)


def test_auto_picks_native_flash_and_is_correct():
    rng = np.random.default_rng(3)
    q, k, v = random_qkv(rng, (2,), 40, 50, 8, 8, np.float32)
    assert_matches_reference(attnkern.attention(q, k, v), q, k, v)
    assert attnkern._api._auto().name == "native.flash"
