"""Loaded by every Python process of a test engine whose PYTHONPATH starts here (vLLM's API server,
engine core and worker), where TRITON_INTERPRET=1: Triton's interpreter runs vLLM's Triton kernels on
CPU tensors, so that Model Runner V2 (which needs Triton; vLLM's CPU build wants triton-cpu, which
this machine's package index lacks) runs in the real engine.

One fix to the interpreter, none to vLLM: Triton 3.9's interpreter hands its numpy load and store
some of vLLM's masks (``&`` of i1 values, e.g. the bitmask kernel's ``position_is_active & bitmask &
in_vocab``; i1 where Triton compiles them) as int32 0/1, which they refuse ("mask has unsupported
dtype"). Such a mask is given to them as bool; its values are the same."""
import os

if os.environ.get("TRITON_INTERPRET") == "1":
    try:
        import triton.runtime.interpreter as _interpreter_module
    except ImportError:          # no Triton: vLLM runs the V1 runner and says so
        pass
    else:
        class _BoolMasks:
            def __init__(self, inner):
                self._inner = inner

            def __getattr__(self, name):
                return getattr(self._inner, name)

            def load(self, ptrs, mask, *args):
                return self._inner.load(ptrs, mask.astype(bool, copy=False), *args)

            def store(self, ptrs, value, mask):
                return self._inner.store(ptrs, value, mask.astype(bool, copy=False))

        _interpreter_module._interpreter = _BoolMasks(_interpreter_module._interpreter)
