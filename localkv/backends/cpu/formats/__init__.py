"""The weight formats, below the kernels: the types and their block sizes (types), the GGUF
blocks decoded for the kernels (blocks), and the K-quants' packed form (packed). Nothing here
imports a kernel or the weight API above them (quant)."""
