"""leanfa: FP8 and BF16 prefill attention (flash-attn compatible) for LLM serving."""

from .api import attention, flash_attn_func, flash_attn_varlen_func
from .quant import FP8QKV, quantize_fp8
from .scales import SCALE_BLOCK

__version__ = "0.1.0"

__all__ = [
    "attention",
    "flash_attn_func",
    "flash_attn_varlen_func",
    "quantize_fp8",
    "FP8QKV",
    "SCALE_BLOCK",
    "__version__",
]
