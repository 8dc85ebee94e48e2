"""The Triton interpreter without a redundant cost: re-patching `triton.language` on every call of a
`@triton.jit` helper made from inside a running kernel.

Under TRITON_INTERPRET=1 a kernel's launch (`GridExecutor.__call__`) swaps the builtins of
`triton.language` for interpreted ones (`_patch_lang`) and puts them back when the grid is done. A
helper called from the kernel (`InterpretedFunction.__call__`: `_delta_rule_token`, `_prepared_qk`,
...) calls `_patch_lang` again, on the same module objects, although they are patched already and
the repeat's own record of what it changed is dropped (the launch's record restores the originals).
The repeat walks every member of the language modules (`inspect.getmembers`): about 0.9 ms a
call, and a delta-rule prefill calls its per-token helper thousands of times per step (a fifth to
a quarter of an interpreted engine's time, measured on tiny-zamba2 and qwen3.5-35b-a3b-shape).

`install()` wraps `_patch_lang`: when every language module the function sees (triton.language,
triton.language.core) is already patched, it returns an empty patch scope (its `restore` does
nothing) instead of patching again; anything else goes to Triton's own function. What runs in the
kernels is unchanged. Only for Triton versions with the functions named here; otherwise a no-op.
"""
from __future__ import annotations

import inspect


def install() -> bool:
    """Wrap the interpreter's `_patch_lang` (idempotent); False where this Triton has no such
    interpreter (or no triton): nothing changed."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    original = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    is_builtin = getattr(tl.core, "is_builtin", None)
    if original is None or scope_type is None or is_builtin is None:
        return False
    if getattr(original, "_skips_repatching", False):
        return True
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
