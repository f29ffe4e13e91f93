"""QK-clip's adapter for Hugging Face attention (Llama, Qwen2/3, Mistral: any attention module
with ``q_proj`` / ``k_proj`` that calls ``ALL_ATTENTION_FUNCTIONS`` with the post-RoPE q, k).

:func:`attention_layers` registers, through transformers' documented ``AttentionInterface``
(and ``AttentionMaskInterface``, so the masks stay those of the implementation in use), an
implementation named ``dmuon_qk_clip|<original>`` that records each call's per-head maxima
(:meth:`~dmuon.optim.qk_clip.HeadLogitMax.observe_qk`: the q and k the kernel receives, the
module's ``scaling``, its mask or ``is_causal`` as ``sdpa`` decides it) while the module is in
training mode, then runs the original (``sdpa``, ``eager``, flash, flex) unchanged, and
switches the model to it. The recording costs an eager attention's logits (float32,
``h·T²`` per batch row) without the softmax; the output and the gradients are the original's.
"""

from __future__ import annotations

import sys
import weakref

from torch import nn

from dmuon.optim.qk_clip import HeadLogitMax

PREFIX = "dmuon_qk_clip|"
_sites: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # attention module -> layer


def _original(module: nn.Module, name: str):
    if name == "eager":  # not in the registry: each modeling file has its own
        return sys.modules[type(module).__module__].eager_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[name]


def _recording(original: str):
    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        site = _sites.get(module)
        if site is not None and module.training:
            causal = kwargs.get("is_causal")
            causal = getattr(module, "is_causal", True) if causal is None else causal
            site.observe_qk(query, key, scaling=kwargs.get("scaling") or module.scaling,
                            mask=attention_mask,
                            is_causal=bool(causal) and attention_mask is None and query.shape[2] > 1)
        return _original(module, original)(module, query, key, value, attention_mask, *args,
                                           **kwargs)
    return attention


def attention_layers(model: nn.Module) -> list[HeadLogitMax]:
    """Record every attention layer's per-head logit maxima; returns them for
    :class:`~dmuon.optim.qk_clip.QKClip`, in model order, named by module.

    Call it on every rank after wrapping (``fully_shard`` / ``parallelize_module`` replace the
    params the clip scales) and before training. Heads: ``config.num_attention_heads``,
    ``config.num_key_value_heads`` (GQA), ``module.head_dim``.

    Raises:
        ValueError: ``model`` has no HF config, no module with ``q_proj`` and ``k_proj``, or
            an attention module's projections do not match the config's heads.
    """
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl is None:
        raise ValueError(f"Invalid model {type(model).__name__}: no Hugging Face config with "
                         "_attn_implementation. attention_layers(model) takes a transformers "
                         "model; for another model build HeadLogitMax per layer and call its "
                         "observe_qk from the attention.")
    layers = []
    for name, m in model.named_modules():
        q, k = getattr(m, "q_proj", None), getattr(m, "k_proj", None)
        if not (isinstance(q, nn.Module) and isinstance(k, nn.Module)):
            continue
        cfg = getattr(m, "config", config)
        heads = cfg.num_attention_heads
        kv = getattr(cfg, "num_key_value_heads", None) or heads
        head_dim = getattr(m, "head_dim", None) or cfg.hidden_size // heads
        site = HeadLogitMax(name, q.weight, k.weight, n_heads=heads, n_kv_heads=kv,
                            head_dim=head_dim, q_bias=getattr(q, "bias", None),
                            k_bias=getattr(k, "bias", None))
        _sites[m] = site
        layers.append(site)
    if not layers:
        raise ValueError(f"Invalid model {type(model).__name__}: no module has q_proj and k_proj. "
                         "attention_layers(model) adapts Llama/Qwen-style attention; for another "
                         "layout build HeadLogitMax per layer and call its observe_qk.")
    if not impl.startswith(PREFIX):
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

        AttentionInterface.register(PREFIX + impl, _recording(impl))
        if impl in ALL_MASK_ATTENTION_FUNCTIONS:
            AttentionMaskInterface.register(PREFIX + impl, ALL_MASK_ATTENTION_FUNCTIONS[impl])
        _set_implementation(model, PREFIX + impl)
    return layers


def detach(model: nn.Module) -> None:
    """Stop recording: the model's original attention implementation back, its layers gone."""
    impl = model.config._attn_implementation
    if impl.startswith(PREFIX):
        _set_implementation(model, impl[len(PREFIX):])
    for m in model.modules():
        _sites.pop(m, None)


def _set_implementation(model: nn.Module, impl: str) -> None:
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(impl)
    else:  # pragma: no cover - transformers < 4.48
        model.config._attn_implementation = impl
