"""Which GDN implementation HF transformers' Qwen3.5 layers call for prompts.

Shared by tools/hf_compare.py and bench/peers/peers.py: both report it in their JSON, because HF
runs flash-linear-attention's kernel when that package is importable and its own fp32 torch code
otherwise, and the two differ in speed and numerics.
"""
import sys


def hf_gdn_impl(model):
    """'module.function' of the chunked GDN rule the model's first GDN layer calls, or '?'."""
    gdn = model.model.layers[0].linear_attn
    f = getattr(gdn, "chunk_gated_delta_rule", None)
    if f is None:
        f = getattr(sys.modules.get(type(gdn).__module__), "chunk_gated_delta_rule", None)
    return f"{getattr(f, '__module__', '?')}.{getattr(f, '__name__', '?')}" if f is not None else "?"
