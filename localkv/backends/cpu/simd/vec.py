"""The vector types of the kernels (U8x32, I32x8, F32x8, I32x16, F32x16) and the LLVM IR
helpers every SIMD module here builds on: element addresses, broadcasts, the CPU features
numba compiles for, and declarations of LLVM's own intrinsics.

Offsets are in elements of the array passed (bytes for uint8 arrays); arrays must be
C-contiguous, and nothing is bounds-checked: callers keep offsets inside the array.
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import models, register_model

I8, I16, I32, F32 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.FloatType()
V8I32, V8F32, V32I8 = ir.VectorType(I32, 8), ir.VectorType(F32, 8), ir.VectorType(I8, 32)
V16I32, V16F32 = ir.VectorType(I32, 16), ir.VectorType(F32, 16)
FAST = ("fast",)


class Vec(types.Type):
    """An LLVM vector held in registers: U8x32, I32x8, F32x8, I32x16 or F32x16."""

    def __init__(self, name: str, llvm_type):
        self.llvm_type = llvm_type
        super().__init__(name=name)


@register_model(Vec)
class _VecModel(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, fe_type.llvm_type)


U8x32 = Vec("U8x32", V32I8)
I32x8 = Vec("I32x8", V8I32)
F32x8 = Vec("F32x8", V8F32)
I32x16 = Vec("I32x16", V16I32)
F32x16 = Vec("F32x16", V16F32)
FLOATS = {I32x8: F32x8, I32x16: F32x16}  # an integer vector type -> the float one of its lanes


def ptr(context, builder, arrty, arr, off, vec_type=None):
    """Address of element `off` of a C-contiguous array, as a pointer to vec_type (or the element)."""
    data = context.make_array(arrty)(context, builder, value=arr).data
    p = builder.gep(data, [builder.sext(off, ir.IntType(64)) if off.type.width < 64 else off])
    return builder.bitcast(p, vec_type.as_pointer()) if vec_type is not None else p


def splat(builder, value, vec_type):
    """value in every lane of vec_type."""
    v = builder.insert_element(ir.Constant(vec_type, ir.Undefined), value, ir.Constant(I32, 0))
    return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(I32, vec_type.count), [0] * vec_type.count))


def features(context) -> str:
    """The CPU features numba compiles for ("+avx2,+fma,..."): part of numba's cache key, so a
    cached kernel never runs on a CPU it was not built for."""
    return getattr(context.codegen(), "_tm_features", "") or ""


def function(builder, name, ret, args):
    """LLVM's intrinsic `name` (ret (args)), declared in the module being built."""
    return cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, args), name)
