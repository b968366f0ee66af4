"""Intel AMX tile instructions for numba kernels, written as LLVM IR intrinsics (see
kernels/superblock_amx).

A tile register (tmm0-tmm7) is named by a constant: each op takes its tile numbers as integer
literals. Addresses are an array and an element offset into it (C-contiguous arrays, nothing
bounds-checked), strides are in bytes. A thread must load a tile configuration (tile_config)
before its first tile op, and the process must hold the kernel's permission for the tile
state (kernels/superblock_amx.enable), or the first op is an illegal instruction.
"""

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

_I8, _I64 = ir.IntType(8), ir.IntType(64)
_P8 = ir.PointerType(_I8)


def _call(builder, name: str, args: list):
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [a.type for a in args]), name)
    builder.call(fn, args)


def _addr(context, builder, arrty, arr, off):
    data = context.make_array(arrty)(context, builder, value=arr).data
    return builder.bitcast(builder.gep(data, [_wide(builder, off)]), _P8)


def _wide(builder, v):
    return builder.sext(v, _I64) if v.type.width < 64 else v


def _tile(t) -> ir.Constant:
    return ir.Constant(_I8, t.literal_value)


def _literal(*ts) -> bool:
    return all(isinstance(t, types.IntegerLiteral) and 0 <= t.literal_value < 8 for t in ts)


@intrinsic
def tile_config(typingctx, cfg):
    """Load the 64-byte tile configuration at cfg[0:] (ldtilecfg)."""

    def codegen(context, builder, sig, args):
        _call(builder, "llvm.x86.ldtilecfg", [_addr(context, builder, sig.args[0], args[0], ir.Constant(_I64, 0))])

    return types.void(cfg), codegen


@intrinsic
def tile_release(typingctx):
    def codegen(context, builder, sig, args):
        _call(builder, "llvm.x86.tilerelease", [])

    return types.void(), codegen


@intrinsic(prefer_literal=True)
def tile_zero(typingctx, t):
    if not _literal(t):
        return None

    def codegen(context, builder, sig, args):
        _call(builder, "llvm.x86.tilezero", [_tile(sig.args[0])])

    return types.void(t), codegen


def _move(name: str):
    def typer(typingctx, t, arr, off, stride):
        if not _literal(t):
            return None

        def codegen(context, builder, sig, args):
            addr = _addr(context, builder, sig.args[1], args[1], args[2])
            _call(builder, name, [_tile(sig.args[0]), addr, _wide(builder, args[3])])

        return types.void(t, arr, off, stride), codegen

    return intrinsic(prefer_literal=True)(typer)


tile_load = _move("llvm.x86.tileloadd64")  # tile_load(t, arr, off, stride): rows `stride` bytes apart
tile_store = _move("llvm.x86.tilestored64")  # tile_store(t, arr, off, stride)


@intrinsic(prefer_literal=True)
def tile_dot_u8i8(typingctx, c, a, b):
    """Tile c (int32) += tile a (unsigned bytes) times tile b (signed bytes, in 4-byte groups):
    tdpbusd. Integer sums: exact."""
    if not _literal(c, a, b):
        return None

    def codegen(context, builder, sig, args):
        _call(builder, "llvm.x86.tdpbusd", [_tile(s) for s in sig.args])

    return types.void(c, a, b), codegen
