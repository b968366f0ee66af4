"""The weight types kept in place, their block sizes (gguf's table, the one source), and how
many activations share one int8 scale when multiplied with each."""

from localkv import gguf_py

BLOCK_TYPES = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
FLOAT_TYPES = ("F32", "F16", "BF16")  # kept as [rows, cols] arrays (F16 and BF16 as uint16 in the kernels)


def block_size(qtype: str) -> tuple[int, int]:
    """(values, bytes) of one block."""
    return gguf_py.block_size(qtype)


def activation_group(qtype: str) -> int:
    """How many activations share one int8 scale when multiplied with weights of qtype: 256
    for the K-quants (llama.cpp's Q8_K, so that their kernels multiply a 256-value super-block
    in integers), 32 for the other block types (Q8_0)."""
    return 256 if qtype.endswith("_K") else 32
