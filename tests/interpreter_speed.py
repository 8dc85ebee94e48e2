"""The Triton interpreter without four of its redundant costs: work whose result nothing reads.

Under TRITON_INTERPRET=1 every `tl` operation of a kernel goes through Triton's Python front end
(`TritonSemantic`, the same code that builds IR for a compile) with an `InterpreterBuilder` that runs
NumPy instead of emitting IR. Four things in it cost time and change nothing the kernel computes:

1. **Re-patching `triton.language` per helper call.** A kernel's launch (`GridExecutor.__call__`)
   swaps the builtins of `triton.language` for interpreted ones (`_patch_lang`) and puts them back
   when the grid is done. A `@triton.jit` helper called from the kernel (`InterpretedFunction.__call__`:
   `_delta_rule_token`, `_prepared_qk`, ...) calls `_patch_lang` again on the same, already patched
   modules; the repeat walks every member of the language modules (`inspect.getmembers`, about 0.9 ms
   a call, thousands of calls per step in the delta-rule kernels) and its record of what it changed
   is dropped (the launch's record restores the originals). Skipped when every language module the
   function sees is patched already (`_patch_lang` returns an empty scope).
2. **The integer-overflow sanitizer's unread check.** `add`, `sub` and `mul` on 32-bit ints call
   `binary_op_sanitize_overflow_impl`, which recomputes the operation in int64, compares it with the
   type's bounds and hands the result to `device_assert`, which returns at once unless the builder's
   options say `debug` (the interpreter's `InterpreterOptions()`: False). So no assertion is ever made
   and the int64 work (a quarter of an interpreted engine's time) is thrown away. Skipped while
   `debug` is False; with `debug` on, Triton's own runs.
3. **Broadcasting two blocks of one shape.** `broadcast_impl_value` compares the operands' shapes
   (tuples) with the shape it computed (a list), which never compare equal, so every binary operation
   on two blocks broadcasts both to the shape they already have (two `np.broadcast_to` views and two
   block types). Operands of equal shapes are returned as they are.
4. **`_get_np_dtype`'s table, built per call.** The mapping from Triton dtypes to NumPy dtypes is a
   dict literal of 19 `np.dtype(...)` built on every call (hundreds of thousands per engine run).
   Built once; the same lookups.

Measured on the backend-parity run of tiny-zamba2 (chunked, mixed batch on the Triton backend): 12.4 ->
8.5 s, its logits bitwise equal. `install()` patches only what this Triton has under the names used
here (each patch checks its target and is skipped otherwise) and only the interpreter's own semantic
object and builder functions: a compile (tests/test_compile_for_gpus.py's workers, another process)
is untouched. `tests/test_interpreter_speed.py` checks each patch computes what Triton's own does.
"""
from __future__ import annotations

import inspect


def install() -> bool:
    """Install the four patches (idempotent); False where this Triton has no such interpreter (or no
    triton): nothing changed. Each patch whose target this Triton lacks is left out."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    if getattr(interpreter, "_runnerscope_speed", None) is not None:
        return True
    installed = [name for name, patch in (("repatch", _skip_repatching), ("sanitizer", _skip_unread_sanitizer),
                                          ("broadcast", _equal_shapes_unbroadcast), ("np_dtype", _np_dtype_table))
                 if patch(interpreter, tl)]
    interpreter._runnerscope_speed = installed
    return bool(installed)


def installed() -> list[str]:
    """The names of the patches in place (empty before install() or without triton)."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return []
    return list(getattr(interpreter, "_runnerscope_speed", None) or [])


def _skip_repatching(interpreter, tl) -> bool:
    original = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    is_builtin = getattr(tl.core, "is_builtin", None)
    if original is None or scope_type is None or is_builtin is None:
        return False
    languages = (tl, tl.core)

    def patch_lang(fn):
        langs = [v for v in fn.__globals__.values() if inspect.ismodule(v) and v in languages]
        if langs and not any(is_builtin(getattr(lang, "arange", None)) for lang in langs):
            return scope_type()             # patched by the running launch: nothing to do or undo
        return patch_lang.original(fn)

    patch_lang.original = original          # Triton's own
    patch_lang._skips_repatching = True
    interpreter._patch_lang = patch_lang
    return True


def _semantic(interpreter, method: str):
    """The interpreter's semantic object and Triton's own bound `method` of it, or None."""
    semantic = getattr(interpreter, "interpreter_semantic", None)
    original = getattr(semantic, method, None)
    return (semantic, original) if original is not None else None


def _skip_unread_sanitizer(interpreter, tl) -> bool:
    found = _semantic(interpreter, "binary_op_sanitize_overflow_impl")
    if found is None or not hasattr(getattr(found[0], "builder", None), "options"):
        return False
    semantic, original = found

    def sanitize_overflow(lhs, rhs, binary_op):
        if not semantic.builder.options.debug:    # device_assert would drop the check unread
            return None
        return original(lhs, rhs, binary_op)

    sanitize_overflow.original = original
    semantic.binary_op_sanitize_overflow_impl = sanitize_overflow
    return True


def _equal_shapes_unbroadcast(interpreter, tl) -> bool:
    found = _semantic(interpreter, "broadcast_impl_value")
    if found is None:
        return False
    semantic, original = found

    def broadcast_impl_value(lhs, rhs):
        lhs_ty, rhs_ty = lhs.type, rhs.type
        if lhs_ty.is_block() and rhs_ty.is_block() and lhs_ty.get_block_shapes() == rhs_ty.get_block_shapes():
            return lhs, rhs
        return original(lhs, rhs)

    broadcast_impl_value.original = original
    semantic.broadcast_impl_value = broadcast_impl_value
    return True


def _np_dtype_table(interpreter, tl) -> bool:
    import numpy as np
    original = getattr(interpreter, "_get_np_dtype", None)
    if original is None:
        return False
    names = ["int1", "float16", "float32", "float64", "int8", "uint8", "int16", "uint16", "int32", "uint32",
             "int64", "uint64", "bfloat16", "float8e5", "float8e5b16", "float8e4nv", "float8e4b8", "float8e4b15"]
    try:
        table = {getattr(tl, name): original(getattr(tl, name)) for name in names}   # Triton's own answers
    except (AttributeError, KeyError):
        return False
    pointer = np.dtype(np.uint64)

    def get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.block_type):
            tt_dtype = tt_dtype.element_ty
        if isinstance(tt_dtype, tl.pointer_type):
            return pointer
        return table[tt_dtype]

    get_np_dtype.original = original
    interpreter._get_np_dtype = get_np_dtype
    return True
