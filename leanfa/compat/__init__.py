"""Compatibility layers: :mod:`leanfa.compat.flash_attn` mirrors flash-attn 2's functions;
:mod:`leanfa.flash_attn_interface` mirrors FlashAttention-3's."""
