"""attn_implementation="attnkern" (attnkern.integrations.transformers) in tiny models
built from a config (no weights downloaded), against attn_implementation="sdpa":
Llama with grouped k/v heads (logits, gradients, generate with a KV cache, chunked
prefill, left padding, 50 AdamW steps), Bert with right padding and attention
dropout, and a decoder layer under torch.compile(fullgraph=True)."""

import inspect

import numpy as np
import pytest

import attnkern

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
import attnkern.integrations.transformers as ak  # noqa: E402

MASKS = "attn_mask" in inspect.signature(attnkern.attention).parameters
needs_masks = pytest.mark.skipif(not MASKS, reason="attnkern.attention has no attn_mask / dropout_p yet")
NAME = ak.register()


def llama(seed=0, **overrides):
    config = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      **overrides)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(config).eval()


def pair(build=llama, **overrides):
    """The same model (same weights) under sdpa and attnkern."""
    ref, ours = build(**overrides), build(**overrides)
    ref.set_attn_implementation("sdpa")
    ours.set_attn_implementation(NAME)
    ours.load_state_dict(ref.state_dict())
    return ref, ours


@pytest.fixture
def ids():
    seed = np.random.SeedSequence().entropy
    print(f"seed {seed}")
    return torch.tensor(np.random.default_rng(seed).integers(1, 97, (2, 13)))  # 0: the pad token


def test_registered_name_is_used():
    _, model = pair()
    assert model.config._attn_implementation == NAME
    assert NAME in transformers.AttentionInterface._global_mapping


def test_check_finite_is_off_unless_registered_on(ids, monkeypatch):
    """register() passes check_finite=False (SDPA and FlashAttention check nothing; on the GPU
    the check waits for it at every call), register(check_finite=True) passes True: a NaN in
    the queries is then a ValueError naming q, where unchecked it flows into the logits."""
    seen = []
    real = attnkern.attention
    monkeypatch.setattr(attnkern, "attention", lambda *a, **kw: seen.append(kw["check_finite"]) or real(*a, **kw))
    _, model = pair()
    with torch.no_grad():
        model(ids)
        assert seen and not any(seen)
        model.set_attn_implementation(ak.register("attnkern_checked", check_finite=True))
        seen.clear()
        model(ids)
        assert seen and all(seen)
        model.model.layers[0].self_attn.q_proj.weight[0, 0] = float("nan")
        with pytest.raises(ValueError, match="^q contains NaN or infinity"):
            model(ids)
        model.set_attn_implementation(NAME)
        assert not torch.isfinite(model(ids).logits).all()
    with pytest.raises(TypeError, match="check_finite must be True or False"):
        ak.register("attnkern_unchecked", check_finite=1)


def test_llama_gqa_logits_and_gradients_match_sdpa(ids):
    ref, ours = pair()
    outs = []
    for model in (ref, ours):
        model.zero_grad()
        out = model(ids, labels=ids)
        out.loss.backward()
        outs.append((out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    torch.testing.assert_close(outs[1][0], outs[0][0], atol=2e-5, rtol=1e-4)
    for name, grad in outs[0][1].items():
        torch.testing.assert_close(outs[1][1][name], grad, atol=2e-5, rtol=1e-3, msg=name)


def test_generate_with_kv_cache_gives_the_same_tokens(ids):
    ref, ours = pair()
    kw = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(ours.generate(ids, **kw), ref.generate(ids, **kw))


def test_chunked_prefill_matches_one_prefill(ids):
    """A prompt fed in chunks of 5 over a growing dynamic cache (bottom-right causal)
    gives the logits of one pass."""
    _, ours = pair()
    whole = ours(ids).logits
    cache = transformers.DynamicCache(config=ours.config)
    chunks = [ours(ids[:, i:i + 5], past_key_values=cache, use_cache=True).logits for i in range(0, 13, 5)]
    torch.testing.assert_close(torch.cat(chunks, 1), whole, atol=2e-5, rtol=1e-4)


def left_padded(ids):
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.skipif(MASKS, reason="attnkern.attention takes attn_mask")
def test_padded_batch_is_refused_without_masks(ids):
    _, ours = pair()
    ids, mask = left_padded(ids)
    with pytest.raises(NotImplementedError, match="padded batch"):
        ours(ids, attention_mask=mask)
    ours(ids, attention_mask=torch.ones_like(ids))  # a mask of ones pads nothing: no mask needed


@needs_masks
def test_left_padding_logits_and_generate_match_sdpa(ids):
    ref, ours = pair()
    ids, mask = left_padded(ids)
    want, got = (m(ids, attention_mask=mask).logits for m in (ref, ours))
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=2e-5, rtol=1e-4)
    kw = {"attention_mask": mask, "max_new_tokens": 6, "do_sample": False, "pad_token_id": 0}
    assert torch.equal(ours.generate(ids, **kw), ref.generate(ids, **kw))


def bert(seed=0, dropout=0.0):
    config = transformers.BertConfig(vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                     num_attention_heads=4, max_position_embeddings=64,
                                     attention_probs_dropout_prob=dropout, hidden_dropout_prob=0.0)
    torch.manual_seed(seed)
    return transformers.BertForMaskedLM(config).eval()


def test_bert_without_padding_matches_sdpa(ids):
    ref, ours = pair(bert)
    mask = torch.ones_like(ids)
    for kw in ({}, {"attention_mask": mask}):
        torch.testing.assert_close(ours(ids, **kw).logits, ref(ids, **kw).logits, atol=2e-5, rtol=1e-4)


@pytest.mark.skipif(MASKS, reason="attnkern.attention takes attn_mask")
def test_bert_padding_and_dropout_are_refused_without_masks(ids):
    _, ours = pair(bert, dropout=0.1)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    with pytest.raises(NotImplementedError, match="padded batch"):
        ours(ids, attention_mask=mask)
    ours.train()
    with pytest.raises(NotImplementedError, match="dropout"):
        ours(ids)


@needs_masks
def test_bert_right_padding_matches_sdpa(ids):
    ref, ours = pair(bert)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    want, got = (m(ids, attention_mask=mask).logits for m in (ref, ours))
    real = mask.bool()
    torch.testing.assert_close(got[real], want[real], atol=2e-5, rtol=1e-4)


@needs_masks
def test_bert_attention_dropout_in_training(ids):
    """Dropout 0.1 in training: the loss varies from draw to draw around the sdpa
    model's mean loss (the same distribution), and eval has no dropout."""
    ref, ours = pair(bert, dropout=0.1)
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0
    losses = {}
    for name, model in (("sdpa", ref), ("ours", ours)):
        model.train()
        with torch.no_grad():
            losses[name] = torch.stack([model(ids, attention_mask=mask, labels=ids).loss for _ in range(40)])
        model.eval()
    assert losses["ours"].std() > 0
    diff = (losses["ours"].mean() - losses["sdpa"].mean()).abs()
    assert diff <= 4 * (losses["ours"].var() / 40 + losses["sdpa"].var() / 40).sqrt() + 1e-6
    with torch.no_grad():
        torch.testing.assert_close(ours(ids, attention_mask=mask).logits, ref(ids, attention_mask=mask).logits,
                                   atol=2e-5, rtol=1e-4)


def test_fifty_adamw_steps_give_sdpa_losses(ids):
    ref, ours = pair()
    losses = {}
    for name, model in (("sdpa", ref), ("ours", ours)):
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses[name] = []
        for _ in range(50):
            opt.zero_grad()
            loss = model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            losses[name].append(loss.item())
    assert losses["ours"][-1] < losses["ours"][0] - 1.0  # it trains
    np.testing.assert_allclose(losses["ours"], losses["sdpa"], rtol=1e-4, atol=1e-4)


def test_decoder_layer_compiles_fullgraph_with_no_graph_breaks():
    import torch._dynamo

    _, ours = pair()
    layer, rotary = ours.model.layers[0], ours.model.rotary_emb
    torch.manual_seed(1)
    hidden = torch.randn(2, 11, 64, requires_grad=True)
    position_embeddings = rotary(hidden, torch.arange(11)[None].expand(2, -1))

    def block(h):
        out = layer(h, attention_mask=None, position_embeddings=position_embeddings)
        return out[0] if isinstance(out, tuple) else out

    explained = torch._dynamo.explain(block)(hidden)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    torch._dynamo.reset()
    eager = block(hidden)
    eager.sum().backward()
    eager_grad = hidden.grad.clone()
    hidden.grad = None
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")(hidden)
    compiled.sum().backward()
    torch.testing.assert_close(compiled, eager, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(hidden.grad, eager_grad, atol=1e-6, rtol=1e-5)
