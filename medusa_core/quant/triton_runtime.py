"""Where the project's Triton kernels run: compiled for CUDA, or on CPU tensors under Triton's
interpreter (``TRITON_INTERPRET=1``, how CI tests them). The choice is made at a kernel's first
launch, not at import, so a test can switch the interpreter on after triton was imported.

Every kernel module (the NF4 matmuls, the row-exact attention, norm and lm_head) launches through
``launchable`` and refuses a device it cannot run on through ``check_runnable``."""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError as err:  # one line, naming the fix; the rest of the project never needs Triton
    raise ImportError(f"medusa_core's Triton kernels need Triton ({err}): pip install 'triton>=3.7'") from None

INTERPRET_ENV = "TRITON_INTERPRET"


def interpret_enabled() -> bool:
    return os.environ.get(INTERPRET_ENV, "0") == "1"


def check_runnable(device: torch.device) -> None:
    """One-line error where Triton cannot run the project's kernels on ``device``."""
    if device.type == "cuda":
        return
    if device.type == "cpu" and interpret_enabled():
        return
    raise RuntimeError(f"the Triton kernels of --nf4-kernel triton/repacked/repacked-exact need a CUDA device; on "
                       f"{device.type} they run only under Triton's interpreter: set {INTERPRET_ENV}=1 (slow, for "
                       "tests) or use --nf4-kernel bnb")


def helper(fn):
    """A function the kernels call (a ``tl.reduce`` combine, or a part of a kernel), in its compiled form always.
    ``triton.jit`` at import under TRITON_INTERPRET=1 gives the interpreter's form, which a kernel compiled for a
    GPU cannot call: the SASS checks of the norm failed once a test had imported it under the interpreter. The
    interpreter runs this form as plain Python: it calls a combine's function itself, and a kernel's call of a
    helper reaches ``__call__``, which a compiled kernel never calls (it inlines the helper's source)."""
    from triton.runtime.jit import JITFunction

    class Helper(JITFunction):
        def __call__(self, *args, **kwargs):
            return self.fn(*args, **kwargs)

    return Helper(fn)


def unspecialized(*names: str):
    """A kernel's integer arguments that Triton should compile one kernel for, whatever their value. Triton
    otherwise compiles another kernel where an integer is 1 or divisible by 16, and a 7B load's tuners then
    compile twice as many (docs/performance.md, "Compiled side by side"). For arguments whose value does not
    change the kernel's main loop (checked in the SASS)."""
    def mark(fn):
        fn.do_not_specialize = names
        return fn
    return mark


# Programmatic dependent launch (Hopper and later): off unless a benchmark turns it on (set_dependent_launch).
_dependent_launch = False


def set_dependent_launch(on: bool, device: torch.device | None = None) -> None:
    """Whether the step's own kernels (the NF4 matmul, the norm, the rotary, the cache write and the split
    attention) launch as programmatic dependents of the kernel before them.

    Why: in a graphed 7B step the kernels run back to back, and each waits for the one before to finish, flush
    and be replaced before its first program starts; then its first loads wait on memory. On the H200 (11-29) the
    one-node step's kernels took 3.20 ms of its 3.38, and a one-row 4096->11008 matmul whose bytes take 5.6 µs
    took 17.5. Launched as a dependent, a kernel's programs start once every program of the kernel before has
    started and said so (each of these says so first thing), and wait (``gdc_wait``) for that kernel's end and
    its memory before they read anything it could have written: the matmul first loads its first group of
    weights, which no kernel writes. The same arithmetic in the same order, so the same bits. Off by default:
    what it gains is the GPU's to measure (``bench_synthetic --dependent-launch off on``). ``device``: checked
    (None: kernels compiled without one, as benchmarks/kernel_sass.py does)."""
    global _dependent_launch
    if on and device is not None:
        check_dependent_launch(device)
    _dependent_launch = on


def check_dependent_launch(device: torch.device) -> None:
    """ValueError where ``device`` cannot launch kernels as dependents: not CUDA, or older than sm_90."""
    if device.type != "cuda":
        raise ValueError(f"dependent launch is a CUDA launch (sm_90 and later) and the device is {device}: leave "
                         "it off there")
    if torch.cuda.get_device_capability(device) < (9, 0):
        raise ValueError(f"dependent launch needs an sm_90 (Hopper) or later GPU and {torch.cuda.get_device_name(device)} "
                         "is not one: leave it off there")


def dependent_launch(interpret: bool) -> dict:
    """A kernel launch's keyword arguments for dependent launch: its PDL constexpr (the kernel's gdc calls) and
    Triton's ``launch_pdl`` option where it is on and compiled (the interpreter has neither)."""
    return {"PDL": True, "launch_pdl": True} if _dependent_launch and not interpret else {}


@functools.cache
def launchable(fn, interpret: bool):
    """A kernel function compiled for CUDA (triton.jit) or run by Triton's interpreter for CPU tensors,
    chosen at first launch: the interpreter choice follows the environment then, not at import."""
    if interpret:
        from triton.runtime.interpreter import InterpretedFunction
        return InterpretedFunction(fn)
    return triton.jit(fn, do_not_specialize=list(getattr(fn, "do_not_specialize", ())))


# The combine functions of the kernels' tl.reduce calls. The kernels use core builtins (tl.full, tl.reduce), not
# tl.zeros, tl.sum or tl.max: those are jit functions of Triton's standard library, decorated when triton is
# imported, so under an interpreter chosen later they refuse to run, and where triton was imported under
# TRITON_INTERPRET=1 a kernel compiled for a GPU cannot call them.
@helper
def start_as_dependent():
    """First thing in a kernel launched as a dependent (set_dependent_launch): the next kernel may start, and this
    one waits for the kernel before it to end and its writes to be seen, before it reads or writes anything."""
    gdc_launch_dependents()
    gdc_wait()


@helper
def add(a, b):
    return a + b


@helper
def maximum(a, b):
    return tl.maximum(a, b)


@helper
def bitwise_xor(a, b):
    return a ^ b
