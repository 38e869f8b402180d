"""attnkern as an attention implementation of Hugging Face transformers (5.x):

    import attnkern.integrations.transformers as ak
    ak.register()                       # once; then
    model = AutoModelForCausalLM.from_config(config, attn_implementation="attnkern")

register() adds an attention function to transformers' AttentionInterface and a
mask function to its AttentionMaskInterface under one name. The mask function
returns no mask (None) only for a plain causal mask whose queries are the last
positions of the keys and with no padding (training without padding, prefill,
decode and chunked prefill with a dynamic cache): the attention function then
runs attnkern's bottom-right causal mask, never materialised. Every other mask
(padding, sliding windows, static caches, custom patterns) is built as
transformers' sdpa builds it, a boolean (batch, 1, Nq, Nk) mask, and passed to
attnkern.attention as attn_mask; an attnkern without attention masks refuses
such a call (NotImplementedError), never drops the mask. Grouped k/v heads are
passed as they are (attnkern reads them without copying). Uses attnkern's public
API only."""

from __future__ import annotations

import inspect

import attnkern

_MASKS = "attn_mask" in inspect.signature(attnkern.attention).parameters


def register(name: str = "attnkern", kernel: str = "auto", *, check_finite: bool = False, **params) -> str:
    """Registers attnkern under `name` in transformers' AttentionInterface and
    AttentionMaskInterface, running `kernel` with tunables `params`; returns name,
    for attn_implementation=name (from_pretrained, from_config, set_attn_implementation).

    check_finite is passed to attnkern.attention. It is off by default, as SDPA and
    FlashAttention check nothing either: on GPU tensors the check scans q, k, v and
    the output and waits for the GPU to read the answer, so every attention call would
    stop the CPU from queueing work ahead of the GPU. register(check_finite=True)
    turns it on (a NaN or infinity in q, k or v is then a ValueError naming it, and a
    non-finite output a FloatingPointError)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if not isinstance(check_finite, bool):
        raise TypeError(f"check_finite must be True or False, got {check_finite!r}")
    if kernel != "auto":
        attnkern.kernel_info(kernel)  # an unknown kernel name fails here, not in a model
    AttentionInterface.register(name, _attention_function(kernel, {**params, "check_finite": check_finite}))
    AttentionMaskInterface.register(name, _mask)
    return name


def _mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
          local_size=None, allow_is_causal_skip=True, **kwargs):
    """transformers' mask function for attnkern: None where the mask is the plain
    causal one aligned bottom-right (queries at the keys' last positions) and no key
    is padding, else sdpa's boolean mask, built without its top-left shortcut."""
    from transformers.masking_utils import causal_mask_function, prepare_padding_mask, sdpa_mask

    if mask_function is None:
        mask_function = causal_mask_function
    if (allow_is_causal_skip and mask_function is causal_mask_function and local_size is None
            and isinstance(q_offset, int) and isinstance(kv_offset, int)
            and q_offset + q_length == kv_offset + kv_length):
        padding = prepare_padding_mask(attention_mask, kv_length, kv_offset)
        if padding is None:
            return None
        import torch

        if not torch.compiler.is_compiling() and bool(padding.all()):  # reads the mask: not while tracing
            return None
    return sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, attention_mask,
                     local_size, allow_is_causal_skip=False, **kwargs)


def _attention_function(kernel: str, params: dict):
    def attnkern_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                                   is_causal=None, **kwargs):
        """transformers' attention function: query (B, H, Nq, D), key and value (B, H_kv, Nk, D)
        -> ((B, Nq, H, D), None)."""
        if kwargs.get("position_bias") is not None:
            raise NotImplementedError("attnkern's transformers integration has no position_bias (T5-style "
                                      "relative bias); use attn_implementation='sdpa' for this model")
        if kwargs.get("output_attentions"):
            raise NotImplementedError("attnkern never materialises the attention weights: output_attentions=True "
                                      "needs attn_implementation='eager'")
        is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        extra = {}
        if attention_mask is not None:
            if not _MASKS:
                raise NotImplementedError(
                    "this attnkern has no attention masks (attnkern.attention(attn_mask=...)): a padded batch, a "
                    "sliding window or a static cache needs one; run unpadded batches with a dynamic cache, or "
                    "use attn_implementation='sdpa'")
            extra["attn_mask"] = attention_mask
        if dropout:
            import torch

            if not _MASKS:
                raise NotImplementedError("this attnkern has no attention dropout (attnkern.attention(dropout_p="
                                          "...)); set the model's attention_dropout to 0 or call model.eval()")
            extra.update(dropout_p=float(dropout), dropout_seed=torch.randint(0, 2**62, (), dtype=torch.int64))
        if kwargs.get("softcap") is not None:
            extra["softcap"] = kwargs["softcap"]
        causal = "bottom_right" if is_causal and attention_mask is None else False
        # the models hand over transposed projections ((B, S, H, D) memory): attnkern uses GPU tensors in
        # place and takes contiguous ones only (.contiguous() is a no-op for those that are)
        query, key, value = (x.contiguous() for x in (query, key, value))
        out = attnkern.attention(query, key, value, causal=causal, scale=scaling, kernel=kernel, **extra, **params)
        return out.transpose(1, 2).contiguous(), None

    return attnkern_attention_forward
