"""The state a recompute replays, read from torch as the checkpoint starts: the device type and devices of its
arguments, their RNG states, the autocast state, the ``torch.device`` context, and the strides of its inputs.

Each shim names, in a ``Removable:`` line, the torch change that would let it go. They all hold on torch 2.13-2.15.
"""

from __future__ import annotations

import types
from typing import Any, ContextManager, TypeAlias

import torch
import torch.overrides as _overrides
import torch.utils._device as _device
import torch.utils.checkpoint as _tuc

from sac2._compat.ops import tree_leaves

__all__ = [
    "checkpoint_devices", "autocast_state", "autocast_contexts", "rng_states", "set_rng_states",
    "device_initialized_since", "device_context", "fresh_device_context", "plain_strides", "restrided",
    "Devices", "AutocastState", "RngStates",
]

#: A checkpoint's device type and the indices of its arguments' non-CPU devices (``checkpoint_devices``).
Devices: TypeAlias = tuple[str, list[int]]
#: One device type's autocast state: (device type, enabled, dtype, cache enabled).
AutocastState: TypeAlias = tuple[str, bool, torch.dtype, bool]
#: The CPU generator's state and, where the device module is initialised, (module, device index, state) for each.
RngStates: TypeAlias = tuple[torch.Tensor, list[tuple[types.ModuleType, int, torch.Tensor]] | None]


def _tensor_leaves(args: tuple[Any, ...]) -> list[torch.Tensor]:
    for a in args:
        if type(a) is not torch.Tensor and isinstance(a, (list, tuple, dict)):
            return [a for a in tree_leaves(args) if isinstance(a, torch.Tensor)]
    return [a for a in args if isinstance(a, torch.Tensor)]  # no containers: no tree walk


def checkpoint_devices(args: tuple[Any, ...]) -> Devices:
    """The device type whose RNG and autocast state a checkpoint replays, and the indices of the non-CPU devices of
    the tensor arguments, as torch's frame infers them (``_infer_device_type``, ``get_device_states``): CUDA
    first, else the first non-CPU type, else the default device type.

    Removable: ``torch.utils.checkpoint`` makes ``_infer_device_type`` public.
    """
    types: list[str] = []
    ids: list[int] = []
    for t in _tensor_leaves(args):
        if not t.is_cpu:
            device = t.device
            types.append(device.type)
            if device.type != "meta":
                ids.append(t.get_device())
    if not types:
        return _tuc.DefaultDeviceType._default_device_type or _tuc.DefaultDeviceType.get_device_type(), ids
    return ("cuda" if "cuda" in types else types[0]), ids


def _device_module(device_type: str) -> types.ModuleType | None:
    module: types.ModuleType | None = None if device_type == "meta" else getattr(torch, device_type, None)
    return module


def _autocast_of(device_type: str) -> AutocastState:
    return (device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type),
            torch.is_autocast_cache_enabled())


_any_autocast = torch._C._is_any_autocast_enabled


def autocast_state(devices: Devices) -> tuple[AutocastState, ...] | None:
    """The autocast state of the checkpoint's device type (where autocast exists) and of the CPU; None when
    autocast is off everywhere (the common case, read with one call).

    Removable: ``torch._C._is_any_autocast_enabled`` becomes public.
    """
    if not _any_autocast():
        return None
    device_type = devices[0]
    states = [_autocast_of("cpu")]
    if device_type != "cpu" and torch.amp.is_autocast_available(device_type):
        states.insert(0, _autocast_of(device_type))
    return tuple(states)


def autocast_contexts(state: tuple[AutocastState, ...] | None) -> list[ContextManager[object]]:
    """The ``torch.autocast`` contexts that make the autocast state ``state`` again; none where it already is.

    Removable: ``torch._C._is_any_autocast_enabled`` becomes public.
    """
    if state is None:
        if not _any_autocast():
            return []
        state = tuple((t, False, torch.get_autocast_dtype(t), torch.is_autocast_cache_enabled())
                      for t in ("cuda", "cpu", "xpu", "mps", "hpu") if torch.is_autocast_enabled(t))
    return [
        torch.amp.autocast(device_type, enabled=enabled, dtype=dtype, cache_enabled=cache)
        for device_type, enabled, dtype, cache in state
        if _autocast_of(device_type) != (device_type, enabled, dtype, cache)
    ]


_cpu_generator = torch.default_generator


def rng_states(devices: Devices) -> RngStates:
    """The CPU generator's state and, if the device type's module is initialised, each argument device's.

    Removable: never: public generator calls (kept beside the other recompute state).
    """
    device_type, ids = devices
    module = _device_module(device_type)
    if module is None or not getattr(module, "_initialized", False):
        return _cpu_generator.get_state(), None
    return _cpu_generator.get_state(), [(module, i, module.get_rng_state(i)) for i in ids]


def set_rng_states(states: RngStates) -> RngStates:
    """Set the states ``rng_states`` took; return the ones they replace.

    Removable: never: public generator calls (kept beside the other recompute state).
    """
    cpu, devices = states
    before: RngStates = _cpu_generator.get_state(), None if devices is None else [
        (m, i, m.get_rng_state(i)) for m, i, _ in devices
    ]
    _cpu_generator.set_state(cpu)
    for module, i, state in devices or ():
        module.set_rng_state(state, i)
    return before


def device_initialized_since(devices: Devices, rng: RngStates) -> bool:
    """Whether the device module was initialised after ``rng`` was taken without its states (torch's frame
    refuses that: the device's RNG state could not be replayed).

    Removable: device modules expose 'initialized' publicly.
    """
    return rng[1] is None and bool(getattr(_device_module(devices[0]), "_initialized", False))


def device_context() -> torch.device | None:
    """The device of the innermost ``with torch.device(...)`` context, which recompute must run under too.

    Removable: the torch-function mode stack and ``DeviceContext`` become public.
    """
    if not torch._C._len_torch_function_stack():
        return None
    for mode in reversed(_overrides._get_current_function_mode_stack()):
        if isinstance(mode, _device.DeviceContext):
            return mode.device
    return None


def fresh_device_context(device: torch.device) -> ContextManager[object]:
    """A new ``torch.device`` context for recompute (re-entering the forward's own instance corrupts its state).

    Removable: the torch-function mode stack and ``DeviceContext`` become public.
    """
    return _device.DeviceContext(device)


_DisableTorchDispatch = torch._C._DisableTorchDispatch


def plain_strides(x: object) -> tuple[int, ...] | None:
    """A plain strided tensor's strides (what ``restrided`` restores), else None."""
    if type(x) is not torch.Tensor or x.layout is not torch.strided or x.is_nested:
        return None
    return tuple(x.stride())


def restrided(x: object, stride: tuple[int, ...] | None) -> object:
    """``x`` with ``stride`` again if a saved-tensor hook changed its strides: a copy, outside every mode and
    autograd (recompute's graph does not reach the inputs), requiring grad as ``x`` does.

    Removable: never: saved-tensor hooks may return any layout.
    """
    if stride is None or type(x) is not torch.Tensor or tuple(x.stride()) == stride or any(s < 0 for s in stride):
        return x
    with _DisableTorchDispatch(), torch.no_grad():
        y = torch.empty_strided(x.shape, stride, dtype=x.dtype, device=x.device)
        y.copy_(x)
    return y.requires_grad_(x.requires_grad)

