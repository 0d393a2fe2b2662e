"""A small, process-wide ``torch.cuda`` compatibility layer so megatron-core runs on CPU (gloo).

Purpose: megatron-core hard-codes CUDA in places no config flag reaches (rng trackers, rotary
embeddings, pipeline schedules, optimizer type checks, ``clip_grads``). On a machine without
CUDA, :func:`install` makes those calls run on CPU; with CUDA available it does nothing.

What it does (and nothing else):

1. A ``TorchFunctionMode`` rewrites ``device="cuda"`` / ``"cuda:N"`` / ``torch.device("cuda")``
   and bare integer device indices (Megatron passes ``torch.cuda.current_device()``) to CPU, turns
   ``Tensor.cuda()`` into the identity and makes ``Tensor.type()`` report ``torch.cuda.*Tensor``
   names (Megatron's optimizer and ``clip_grads`` check those strings).
2. The ``torch.cuda`` functions Megatron calls (device queries, synchronisation, streams, events,
   nvtx, rng get/set/seed, memory queries) are replaced by CPU equivalents or no-ops; device
   properties raise ``RuntimeError`` as a CPU build of torch does. Each is a
   **distinct** function object: ``torch._dynamo`` asserts when two ``torch.cuda`` attributes are
   the same object. ``torch.cuda.manual_seed`` seeds the CPU generator directly; calling
   ``torch.manual_seed`` would recurse through ``torch.cuda.manual_seed_all``.
3. Megatron's tensor-parallel rng helpers read and write the CPU generator.
4. MoE and recompute (:func:`_patch_moe_and_recompute`, measured with megatron-core 0.16.1):
   A1 the router's ``te_general_gemm`` name exists (as None) without TransformerEngine, else
   every router forward raises ``NameError``; A2 the alltoall dispatcher's split sizes become
   numpy arrays for CPU tensors too (gloo's ``all_to_all_single`` rejects tensors there at EP >=
   2); A3 the backward pass (``torch.autograd.backward``, ``Tensor.backward``) answers
   ``torch.cuda.current_device()`` with the CPU device: it runs with this mode popped (the mode
   pops itself while it handles a call), and the EP all-to-all / all-gather backward, a
   recomputed router and, with more TP ranks than KV heads, the backward of the QKV all-gather
   (a reduce-scatter) allocate on ``current_device()`` (without A3: "Cannot access accelerator
   device" at TP2 over 1 KV head; ``tests/shell/test_tied_embeddings.py``); A4
   ``CheckpointWithoutOutput`` (selective ``layernorm`` recompute) turns its fp8 flag off, which
   0.16.1 sets True for ``fp8=False``; A5 multi-latent attention's ``HAVE_TE`` is False when
   its ``TELinear`` is not a class (megatron's TransformerEngine extension imports without TE,
   with mock names, so 0.16.1 sets ``HAVE_TE`` and then fails on ``isinstance(...,
   TELinear)`` when it builds an MLA layer); A6 the router's expert-bias token count
   (DeepSeek-V3's aux-free balancing) and gated attention's output gate (Qwen3.5's; 6.6 s on
   its first forward) run eagerly: megatron wraps them in ``torch.compile`` at import
   (``jit_fuser``), which on CPU needs a C++ compiler and compiles for seconds; A7
   ``torch.device(<CUDA index>)`` and ``Tensor.new_empty(*sizes)`` (YaRN's rotary tables,
   transformers' DeepSeek-V3 attention) reach the CPU.

``torch.cuda.is_available()`` stays False, so code that branches on it keeps its CPU path.

Cost and the fast path: the mode sees every torch call of the process (~2 us each, ~9k calls
per demo rollout). :func:`native_torch` suspends it where no CUDA name can appear: the model's
forward and the loss (Megatron's one CUDA reference there, rotary embeddings moving their
frequencies to ``torch.cuda.current_device()``, gets the CPU device inside that block) and the
rollout engine's generation. Measured on the demo: step 0.131 -> 0.107 s.

Invariants (tested): installing twice is a no-op; no two patched attributes share an object;
``torch.zeros(2, device="cuda")`` is a CPU tensor; ``t.cuda() is t``; float params report
``torch.cuda.FloatTensor``.
"""

import contextlib
import types

import torch
from megatron.core.pipeline_parallel import schedules
from megatron.core.tensor_parallel import random as mrandom
from megatron.core.tensor_parallel.random import CheckpointWithoutOutput
from megatron.core.transformer import multi_latent_attention
from megatron.core.transformer.attention import Attention
from megatron.core.transformer.moe import moe_utils, token_dispatcher
from megatron.core.transformer.moe.router import TopKRouter
from torch.overrides import TorchFunctionMode, _get_current_function_mode, _pop_mode_temporarily

_STATE: dict[str, object] = {"installed": False, "mode": None}

_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
    torch.float64: "torch.cuda.DoubleTensor",
    torch.int64: "torch.cuda.LongTensor",
    torch.int32: "torch.cuda.IntTensor",
    torch.uint8: "torch.cuda.ByteTensor",
    torch.bool: "torch.cuda.BoolTensor",
}


def _is_cuda_device(device: object) -> bool:
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True  # a bare index means a CUDA device to Megatron; CPU has no index
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _map_device(device: object) -> object:
    return torch.device("cpu") if _is_cuda_device(device) else device


class CpuDeviceMode(TorchFunctionMode):
    """Maps CUDA device arguments to CPU for every torch call made while the mode is active."""

    def __torch_function__(self, func, types_, args=(), kwargs=None):
        # Every torch call of the process passes here: the common case (no device argument,
        # not one of the special methods) must cost one dict lookup and one call.
        special = _SPECIAL.get(func)
        if special is not None:
            return special(func, args, kwargs)
        if kwargs:
            if "device" in kwargs:
                kwargs = {**kwargs, "device": _map_device(kwargs["device"])}
            return func(*args, **kwargs)
        return func(*args)


def _cuda(func, args, kwargs):
    return args[0]


def _type(func, args, kwargs):
    if len(args) == 1 and not kwargs:
        return _CUDA_TYPE_NAMES.get(args[0].dtype) or func(*args)
    return func(*args, **(kwargs or {}))


def _moved(func, args, kwargs):
    if len(args) > 1:
        args = (args[0], _map_device(args[1]), *args[2:])
    if kwargs and "device" in kwargs:
        kwargs = {**kwargs, "device": _map_device(kwargs["device"])}
    return func(*args, **(kwargs or {}))


def _new_empty(func, args, kwargs):
    # the size as one tuple: the function form rejects ``new_empty(2, 3)``'s varargs, which
    # transformers' DeepSeek-V3 attention passes
    if kwargs and "device" in kwargs:
        kwargs = {**kwargs, "device": _map_device(kwargs["device"])}
    size = args[1:]
    if not size:  # new_empty(size=...)
        return func(args[0], **(kwargs or {}))
    size = tuple(size[0]) if len(size) == 1 and not isinstance(size[0], int) else tuple(size)
    return func(args[0], size, **(kwargs or {}))


def _device(func, args, kwargs):
    # torch.device(torch.cuda.current_device()) (YaRN's rotary embedding builds its tables
    # under it): a CUDA type or index names the CPU here
    if args and _is_cuda_device(args[0]):
        return torch.device("cpu")
    return func(*args, **(kwargs or {}))


_SPECIAL = {torch.Tensor.cuda: _cuda, torch.Tensor.type: _type, torch.Tensor.to: _moved,
            torch.Tensor.new_empty: _new_empty, torch.device: _device}


class _Stream:
    """Stand-in for ``torch.cuda.Stream``: work on CPU is synchronous, so waits are no-ops."""

    def __init__(self, *args, **kwargs):
        self.device = torch.device("cpu")

    def synchronize(self) -> None:
        return None

    def wait_stream(self, other) -> None:
        return None

    def wait_event(self, event) -> None:
        return None

    def record_event(self, event=None):
        return event if event is not None else _Event()

    def query(self) -> bool:
        return True


class _Event:
    """Stand-in for ``torch.cuda.Event``; ``elapsed_time`` is 0 because nothing is timed."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def wait(self, stream=None) -> None:
        return None

    def query(self) -> bool:
        return True

    def elapsed_time(self, other) -> float:
        return 0.0


def _cpu_functions() -> dict[str, object]:
    """One fresh function object per patched ``torch.cuda`` attribute (dynamo rejects sharing)."""

    def current_device():
        return 0  # an index, as torch documents (inside native_torch(model=True): the CPU)

    def device_count():
        return 1

    def set_device(device):
        return None

    def synchronize(device=None):
        return None

    def get_rng_state(device="cuda"):
        return torch.get_rng_state()

    def set_rng_state(new_state, device="cuda"):
        torch.set_rng_state(new_state)

    def manual_seed(seed):
        torch.default_generator.manual_seed(int(seed))

    def manual_seed_all(seed):
        torch.default_generator.manual_seed(int(seed))

    def current_stream(device=None):
        return _Stream()

    def default_stream(device=None):
        return _Stream()

    def stream(s=None):
        return contextlib.nullcontext()

    def empty_cache():
        return None

    def memory_allocated(device=None):
        return 0

    def max_memory_allocated(device=None):
        return 0

    def memory_reserved(device=None):
        return 0

    def is_initialized():
        return True

    def get_device_properties(device=None):
        # torch's own answer on a CPU build, which callers such as torch's inductor (run by
        # vLLM-CPU) catch; the real one would reach a CUDA binding that does not exist.
        raise RuntimeError("no CUDA device: vime's CPU compatibility layer is active")

    nvtx = types.SimpleNamespace(
        range_push=lambda *a, **k: None,
        range_pop=lambda *a, **k: None,
        range=lambda *a, **k: contextlib.nullcontext(),
        mark=lambda *a, **k: None,
    )
    return {
        "current_device": current_device, "device_count": device_count,
        "set_device": set_device, "synchronize": synchronize,
        "get_rng_state": get_rng_state, "set_rng_state": set_rng_state,
        "manual_seed": manual_seed, "manual_seed_all": manual_seed_all,
        "current_stream": current_stream, "default_stream": default_stream,
        "stream": stream, "empty_cache": empty_cache, "memory_allocated": memory_allocated,
        "max_memory_allocated": max_memory_allocated, "memory_reserved": memory_reserved,
        "is_initialized": is_initialized, "get_device_properties": get_device_properties,
        "nvtx": nvtx,
        "Stream": type("Stream", (_Stream,), {}), "Event": type("Event", (_Event,), {}),
    }


def _patch_megatron_rng() -> None:
    """Point Megatron's tensor-parallel cuda-rng helpers at the CPU generator."""
    def _get_cpu_rng_state(device="cuda", clone=False, graph_safe=False):
        state = torch.get_rng_state()
        return state.clone() if clone else state

    def _set_cpu_rng_state(new_state, device=-1, graph_safe=False):
        torch.set_rng_state(new_state)

    mrandom._get_cuda_rng_state = _get_cpu_rng_state
    mrandom._set_cuda_rng_state = _set_cpu_rng_state


@contextlib.contextmanager
def _cpu_device_index():
    index = torch.cuda.current_device
    torch.cuda.current_device = _cpu_current_device
    try:
        yield
    finally:
        torch.cuda.current_device = index


def _backward(func, args, kwargs):  # A3, for Tensor.backward (a torch function)
    with _cpu_device_index():
        return func(*args, **(kwargs or {}))


_SPECIAL[torch.Tensor.backward] = _backward


def _patch_moe_and_recompute() -> None:
    """A1-A6 of the module docstring."""
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None  # A1
    to_cpu = token_dispatcher.maybe_move_tensor_to_cpu

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):  # A2
        if as_numpy and torch.is_tensor(tensor) and not tensor.is_cuda:
            return tensor.numpy()
        return to_cpu(tensor, as_numpy=as_numpy, record_stream=record_stream)

    token_dispatcher.maybe_move_tensor_to_cpu = maybe_move_tensor_to_cpu
    for owner, name in ((torch.autograd, "backward"), (schedules, "custom_backward")):  # A3
        original = getattr(owner, name)

        def on_cpu(*args, _original=original, **kwargs):
            with _cpu_device_index():
                return _original(*args, **kwargs)

        setattr(owner, name, on_cpu)
    init = CheckpointWithoutOutput.__init__

    def checkpoint_init(self, fp8=False):  # A4
        init(self, fp8)
        self.fp8 = False

    CheckpointWithoutOutput.__init__ = checkpoint_init
    if not isinstance(multi_latent_attention.TELinear, type):  # A5
        multi_latent_attention.HAVE_TE = False
    for owner, name in ((TopKRouter, "_apply_expert_bias"), (Attention, "_apply_output_gate")):
        compiled = getattr(owner, name)  # A6
        setattr(owner, name, getattr(compiled, "_torchdynamo_orig_callable", compiled))


def install() -> bool:
    """Install the layer once per process; returns True when it is (or already was) active.

    Call it before any Megatron model is built. With CUDA available it returns False and
    changes nothing. Example: ``install(); torch.zeros(1, device="cuda").device.type == "cpu"``.
    """
    if torch.cuda.is_available():
        return False
    if _STATE["installed"]:
        return True
    for name, fn in _cpu_functions().items():
        setattr(torch.cuda, name, fn)
    torch.cuda.random.get_rng_state = torch.cuda.get_rng_state
    torch.cuda.random.set_rng_state = torch.cuda.set_rng_state
    _patch_megatron_rng()
    _patch_moe_and_recompute()
    mode = CpuDeviceMode()
    mode.__enter__()  # process-wide: stays active for the life of the process
    _STATE.update(installed=True, mode=mode)
    return True


@contextlib.contextmanager
def native_torch(*, model: bool = False):
    """Suspend the CPU device mode inside the block (module docstring: the fast path); a no-op
    without the layer, or when another mode is on top of ours (a test's own mode).

    ``model=True`` (Megatron's forward and loss) also answers ``torch.cuda.current_device()``
    with the CPU device inside the block: rotary embeddings move their frequencies there on
    every forward, and without the mode the index 0 would mean a CUDA device. Elsewhere it stays
    the documented index (libraries such as torch's inductor, run by vLLM-CPU, rely on that).
    """
    if not _STATE["installed"] or _get_current_function_mode() is not _STATE["mode"]:
        yield
        return
    index = torch.cuda.current_device
    with _pop_mode_temporarily():
        if model:
            # On purpose a device, not torch's int index: the docstring says why.
            torch.cuda.current_device = _cpu_current_device  # type: ignore[assignment]
        try:
            yield
        finally:
            torch.cuda.current_device = index


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def installed() -> bool:
    """True when the CPU layer is active in this process."""
    return bool(_STATE["installed"])


PATCHED_ATTRIBUTES: tuple[str, ...] = tuple(_cpu_functions())
