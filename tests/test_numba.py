"""What is particular to numba.flash: Numba's on-disk cache and its thread pool.
Its correctness, determinism and concurrency are tested with the other CPU
kernels (conftest.TUNABLE, CPU_TUNABLE)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import attnkern
from conftest import assert_matches_reference, random_qkv

# Numba, SciPy and threadpoolctl are test extras: unavailable means a broken setup
assert attnkern.kernel_info("numba.flash")["available"], attnkern.kernel_info("numba.flash")["reason"]

_FIRST_CALL = """
import json, numpy as np, attnkern
from attnkern.backends.numba import flash
q = np.ones((2, 5, 3), np.float32)
attnkern.attention(q, q, q, kernel="numba.flash")
stats = flash.flash_forward.stats
print(json.dumps({"hits": sum(stats.cache_hits.values()), "misses": sum(stats.cache_misses.values())}))
"""


def test_compiled_code_is_cached_on_disk(tmp_path):
    """The first process compiles and writes Numba's cache; the next one loads it
    instead of compiling (a hit, no miss)."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path)}

    def first_call():
        result = subprocess.run([sys.executable, "-c", _FIRST_CALL], env=env, capture_output=True, text=True,
                                timeout=300)
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout.strip().splitlines()[-1])

    assert first_call() == {"hits": 0, "misses": 1}
    assert list(tmp_path.rglob("*.nbi")), "no cache index written"
    assert first_call() == {"hits": 1, "misses": 0}


def test_num_threads_is_limited_to_numbas_pool():
    q, k, v = random_qkv(np.random.default_rng(0), (2,), 10, 10, 4, 4, np.float32)
    limit = attnkern.kernel_info("numba.flash")["params"]["num_threads"]["max"]
    assert limit == int(os.environ["NUMBA_NUM_THREADS"])  # conftest sets 4
    with pytest.raises(ValueError, match=rf"num_threads={limit + 1} is out of range; allowed: 1 <= num_threads <= "
                                         rf"{limit}"):
        attnkern.attention(q, k, v, kernel="numba.flash", num_threads=limit + 1)
    out = attnkern.attention(q, k, v, kernel="numba.flash", num_threads=limit)
    assert_matches_reference(out, q, k, v)


def test_one_query_block_of_many_rows_and_a_long_key_stream():
    """block_q larger than N, block_k of 1: every key its own block."""
    q, k, v = random_qkv(np.random.default_rng(1), (), 37, 29, 5, 6, np.float64)
    for causal in (False, True):
        out = attnkern.attention(q, k, v, causal=causal, kernel="numba.flash", block_q=1024, block_k=1)
        assert_matches_reference(out, q, k, v, causal)


def test_exp2_constants_are_the_c_kernels():
    """numba.flash repeats the C kernels' log2(e) and 2^f polynomials (Numba compiles
    module constants into its code); they must stay the same numbers."""
    from attnkern.backends.native import _attn
    from attnkern.backends.numba import flash

    assert flash.LOG2E == _attn.LOG2E
    assert flash.EXP2_F32 == _attn.EXP2_F32
    assert flash.EXP2_F64 == _attn.EXP2_F64


@pytest.mark.parametrize("block_q, block_k", [(128, 256), (37, 16), (16, 5), (5, 64)])
def test_causal_diagonal_blocks(block_q, block_k):
    """Causal blocks that cross the diagonal are computed in row chunks up to the last
    key each chunk sees; every row still matches the reference (more keys than queries,
    and fewer)."""
    rng = np.random.default_rng(block_q * 1000 + block_k)
    for nq, nk in [(150, 150), (70, 130), (130, 70)]:
        q, k, v = random_qkv(rng, (2,), nq, nk, 12, 9, np.float32)
        out, lse = attnkern.attention(q, k, v, causal=True, kernel="numba.flash", block_q=block_q,
                                      block_k=block_k, return_lse=True)
        assert_matches_reference(out, q, k, v, causal=True)
        _, expected_lse = attnkern.attention(q, k, v, causal=True, kernel="native.flash", return_lse=True)
        np.testing.assert_allclose(lse, expected_lse, rtol=1e-5, atol=1e-5)
