"""The SIMD vocabulary of the kernels, as LLVM IR intrinsics numba inlines (its loop vectorizer
does not find these): vec (the vector types and IR helpers), u8x32 (bytes and the integer dot
products), f32x8 (float lanes, half and bf16 widening), wide (the 64-byte K-quant super-block
products), transpose (8 x 8 float blocks) and amx (Intel AMX tile instructions)."""
