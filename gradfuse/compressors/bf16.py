"""bf16: the top 16 bits of float32 on the wire (see fp16.py for the shared rules)."""
from .fp16 import Cast16


class BF16(Cast16):
    """bfloat16 on the wire: float32's range, 8 bits of precision."""

    name = "bf16"
    fmt = 2
