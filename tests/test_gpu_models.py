"""The drop-ins and the transformers integration on CUDA tensors as models hand them over:
transposed projections (non-contiguous (B, S, H, D) memory), grouped k/v heads, bf16
autocast. Errors against a float32 run, under FlashAttention's rule: attnkern's error at
most 2x torch SDPA's in the same dtype, plus an atol. Needs a GPU (ATTNKERN_TEST_GPU=1 on
the GPU host); skipped elsewhere."""

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU (run with ATTNKERN_TEST_GPU=1 on the GPU host)", allow_module_level=True)

import attnkern  # noqa: E402
from conftest import require_cuda_kernels  # noqa: E402

require_cuda_kernels()
F = torch.nn.functional


def _fa_rule(ours, theirs, exact, atol):
    """FlashAttention's test rule: max |ours - exact| <= 2 max |theirs - exact| + atol."""
    err, ref = ((x.float() - exact).abs().max().item() for x in (ours, theirs))
    assert err <= 2 * ref + atol, (err, ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_takes_transposed_cuda_tensors(dtype, causal):
    """attnkern.sdpa on (B, S, H, D) projections transposed to (B, H, S, D), as attention
    layers pass them (torch SDPA takes any strides), with enable_gqa: forward and
    gradients against torch SDPA."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    b, s, h, hkv, d = 2, 200, 8, 2, 64
    x = [torch.randn(b, s, n, d, device="cuda", generator=gen) for n in (h, hkv, hkv)]
    dout = torch.randn(b, h, s, d, device="cuda", generator=gen)
    exact = [t.detach().clone().requires_grad_() for t in x]
    leaves = {name: [t.detach().to(dtype).requires_grad_() for t in x] for name in ("ours", "torch")}
    results = {}
    for name, fn in (("ours", attnkern.sdpa), ("torch", F.scaled_dot_product_attention)):
        q, k, v = (t.transpose(1, 2) for t in leaves[name])
        assert not q.is_contiguous()
        out = fn(q, k, v, is_causal=causal, enable_gqa=True)
        out.backward(dout.to(dtype))
        results[name] = [out.detach()] + [t.grad for t in leaves[name]]
    q, k, v = (t.transpose(1, 2) for t in exact)
    out = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=causal, enable_gqa=True)
    out.backward(dout.double())
    for ours, theirs, want in zip(results["ours"], results["torch"], [out.detach()] + [t.grad for t in exact]):
        _fa_rule(ours, theirs, want.float(), 1e-5 if dtype == torch.float32 else 1e-3)


def test_llama_under_bf16_autocast_matches_sdpa():
    """A Llama model from a config (grouped k/v heads) on the GPU under bf16 autocast, a
    left-padded batch and an unpadded one: attn_implementation='attnkern' against 'sdpa'
    (logits and every parameter's gradient), both against the float32 SDPA model."""
    transformers = pytest.importorskip("transformers")
    import attnkern.integrations.transformers as ak

    name = ak.register()
    config = transformers.LlamaConfig(vocab_size=257, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    base = transformers.LlamaForCausalLM(config).cuda()
    ids = torch.randint(1, 257, (2, 300), device="cuda")
    padded = torch.ones_like(ids)
    padded[1, :37] = 0  # left padding of the second sequence
    for mask in (None, padded):
        grads, logits = {}, {}
        for impl, autocast in (("exact", False), ("sdpa", True), (name, True)):
            model = transformers.LlamaForCausalLM(config).cuda()
            model.load_state_dict(base.state_dict())
            model.set_attn_implementation("sdpa" if impl == "exact" else impl)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                # padded positions take no part in the loss: their rows see no key (attnkern gives 0 there)
                out = model(ids, attention_mask=mask, labels=ids if mask is None else ids.masked_fill(mask == 0, -100))
            out.loss.backward()
            keep = slice(None) if mask is None else mask.bool()
            logits[impl] = out.logits.float()[keep].detach()
            grads[impl] = {n: p.grad.float() for n, p in model.named_parameters()}
        _fa_rule(logits[name], logits["sdpa"], logits["exact"], 1e-3)
        for n in grads["exact"]:
            _fa_rule(grads[name][n], grads["sdpa"][n], grads["exact"][n], 1e-4)
