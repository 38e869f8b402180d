"""Realistic inputs: all-MiniLM-L6-v2 run in NumPy on Python's own documentation."""

import json
import struct

import numpy as np

import attnkern
from attnkern_bench import realistic
from conftest import AVAILABLE, assert_matches_reference


def test_safetensors_reader(tmp_path):
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    header = json.dumps({"a": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]},
                         "__metadata__": {"format": "pt"}}).encode()
    path = tmp_path / "t.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + a.tobytes())
    got = realistic.read_safetensors(path)
    assert list(got) == ["a"] and np.array_equal(got["a"], a)


def test_tokenizer():
    assert realistic.basic_tokens("Hello, Wörld!  naïve\tcafé.") == ["hello", ",", "world", "!", "naive", "cafe", "."]
    vocab = {t: i for i, t in enumerate(["[UNK]", "un", "##aff", "##able", "aff"])}
    assert realistic.wordpiece(["unaffable", "aff", "xyz"], vocab) == [1, 2, 3, 4, 0]


def test_the_model_knows_what_sentences_mean():
    """The NumPy forward is the real model: similar sentences embed close together."""
    m = realistic.MiniLM()
    food = m.embed("A man is eating food.")
    sims = [food @ m.embed(s) for s in ("A man is eating a piece of bread.", "A man is riding a horse.",
                                        "The girl is carrying a baby.")]
    assert sims[0] > 0.6 and sims[0] > sims[1] > sims[2]


def test_captured_inputs_are_peaky_cached_and_every_kernel_handles_them():
    first = realistic.capture(96)
    assert first["q"].shape == (6, 12, 96, 32) and first["q"].dtype == np.float32
    again = realistic.capture(96)  # from the cache
    assert all(np.array_equal(first[x], again[x]) for x in "qkv")
    assert list((attnkern.cache_dir() / "realistic").glob("minilm-*.npz"))
    q, k, v = first["q"][2], first["k"][2], first["v"][2]
    rng = np.random.default_rng(0)
    rq, rk = (rng.standard_normal(q.shape).astype(np.float32) for _ in range(2))
    assert realistic.softmax_entropy(q, k) < realistic.softmax_entropy(rq, rk) < np.log(96)
    for kernel in AVAILABLE:
        for causal in (False, True):
            assert_matches_reference(attnkern.attention(q, k, v, causal=causal, kernel=kernel), q, k, v, causal)


def test_a_parquet_file_with_a_text_column(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": ["First line.", None, "Second line."]}), tmp_path / "w.parquet")
    assert realistic.corpus(tmp_path / "w.parquet") == "First line.\nSecond line."
