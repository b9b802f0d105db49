"""``install()``: make code that calls torch's checkpoint API run sac2's modes, without editing that code.

Frameworks import torch's names into their own modules (``from torch.utils.checkpoint import checkpoint`` in
transformers, ``create_selective_checkpoint_contexts`` and ``checkpoint_wrapper as ptd_checkpoint_wrapper`` in
torchtitan and TRL), so changing one import line of your own code changes nothing inside them. ``install()``
rebinds, while it is in effect:

- torch's public entry points: ``torch.utils.checkpoint.checkpoint`` and ``create_selective_checkpoint_contexts``,
  ``checkpoint_wrapper`` and ``apply_activation_checkpointing`` of
  ``torch.distributed.algorithms._checkpoint.checkpoint_wrapper``;
- every name, in every imported module outside ``torch`` and ``sac2``, that *is* one of those torch functions
  (found by scanning ``sys.modules``, so a module that binds them under another name is found too); modules imported
  later get sac2's because the torch attributes they import from are rebound.

Each is rebound to a forwarding function of this module (``sac2.integrations.rebinding.checkpoint``, ...) that runs
sac2's counterpart. Callables handed to them that still lead to torch's functions are redirected as well: torch's
``create_selective_checkpoint_contexts`` (or a ``functools.partial`` of it) as ``context_fn``, and a plain function
such as torchtitan's ``lambda: create_selective_checkpoint_contexts(policy)``, which looks the name up in its
module on every call: the wrapper keeps a copy of it whose globals bind the name to sac2's, so modules wrapped while
installed keep running sac2 after ``uninstall()``.

``uninstall()`` (or leaving the ``with`` block) puts torch's function back in every place that holds a forwarding
function of this module, including modules imported after ``install()``. Objects built while installed that hold a
forwarding function (HF's ``functools.partial(checkpoint, ...)`` made by ``gradient_checkpointing_enable``) keep it
and keep running sac2. What was bound *before* ``install()`` inside objects, not modules, is not reached: call
``install()`` before ``gradient_checkpointing_enable`` and before building the ``Trainer``.
"""

from __future__ import annotations

import functools
import sys
import threading
import types
import weakref
from typing import Any, Callable, Iterator

import torch.utils.checkpoint as _tuc

import sac2

try:
    import torch.distributed.algorithms._checkpoint.checkpoint_wrapper as _tcw
except ImportError:  # torch built without distributed
    _tcw = None

__all__ = [
    "install",
    "installed",
    "Installation",
    "checkpoint",
    "create_selective_checkpoint_contexts",
    "checkpoint_wrapper",
    "apply_activation_checkpointing",
]

_TORCH_CHECKPOINT = _tuc.checkpoint
_TORCH_CONTEXTS = _tuc.create_selective_checkpoint_contexts


class _State(threading.local):
    entering_sac2: bool = False


_state = _State()


def _entered(function: Callable[..., Any]) -> Callable[..., Any]:
    """``function``, clearing the "inside sac2.checkpoint's own call of torch" flag when it runs, so that a
    checkpoint nested in it goes through sac2 again."""

    def run(*args: Any, **kwargs: Any) -> Any:
        _state.entering_sac2 = False
        return function(*args, **kwargs)

    return run


def checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """What ``torch.utils.checkpoint.checkpoint`` is while sac2 is installed: ``sac2.checkpoint``.

    ``sac2.checkpoint`` hands its frame work to torch's checkpoint; that call, which finds this function under
    torch's name, goes to torch's original.
    """
    if _state.entering_sac2:
        _state.entering_sac2 = False
        return _TORCH_CHECKPOINT(function, *args, **kwargs)
    if "context_fn" in kwargs:
        kwargs["context_fn"] = _redirect(kwargs["context_fn"])
    _state.entering_sac2 = True
    try:
        return sac2.checkpoint(_entered(function), *args, **kwargs)
    finally:
        _state.entering_sac2 = False


def create_selective_checkpoint_contexts(policy_fn_or_list: Any, allow_cache_entry_mutation: bool = False) -> Any:
    """What torch's ``create_selective_checkpoint_contexts`` is while sac2 is installed: sac2's."""
    return sac2.create_selective_checkpoint_contexts(policy_fn_or_list, allow_cache_entry_mutation)


def checkpoint_wrapper(
    module: Any,
    checkpoint_impl: Any = None,
    checkpoint_fn: Callable[..., Any] | None = None,
    **checkpoint_fn_kwargs: Any,
) -> Any:
    """What torch's ``checkpoint_wrapper`` is while sac2 is installed: ``sac2.checkpoint_wrapper``.

    ``checkpoint_impl=None`` means torch's default, ``CheckpointImpl.NO_REENTRANT``.
    """
    if checkpoint_impl is None:
        checkpoint_impl = sac2.CheckpointImpl.NO_REENTRANT
    if checkpoint_fn is not None:
        checkpoint_fn = _redirect(checkpoint_fn)
    if "context_fn" in checkpoint_fn_kwargs:
        checkpoint_fn_kwargs["context_fn"] = _redirect(checkpoint_fn_kwargs["context_fn"])
    return sac2.checkpoint_wrapper(module, checkpoint_impl, checkpoint_fn, **checkpoint_fn_kwargs)


def apply_activation_checkpointing(
    model: Any,
    checkpoint_wrapper_fn: Callable[..., Any] = checkpoint_wrapper,
    check_fn: Callable[[Any], bool] = lambda _: True,
    auto_wrap_policy: Any = None,
) -> None:
    """What torch's ``apply_activation_checkpointing`` is while sac2 is installed: sac2's."""
    sac2.apply_activation_checkpointing(model, _redirect(checkpoint_wrapper_fn), check_fn, auto_wrap_policy)


#: torch's function -> the forwarding function that replaces it, and the places torch exposes them publicly.
_REPLACEMENTS: dict[int, tuple[Callable, Callable]] = {
    id(_TORCH_CHECKPOINT): (_TORCH_CHECKPOINT, checkpoint),
    id(_TORCH_CONTEXTS): (_TORCH_CONTEXTS, create_selective_checkpoint_contexts),
}
_ENTRY_POINTS: list[tuple[types.ModuleType, str]] = [
    (_tuc, "checkpoint"),
    (_tuc, "create_selective_checkpoint_contexts"),
]
if _tcw is not None:
    _REPLACEMENTS[id(_tcw.checkpoint_wrapper)] = (_tcw.checkpoint_wrapper, checkpoint_wrapper)
    _REPLACEMENTS[id(_tcw.apply_activation_checkpointing)] = (
        _tcw.apply_activation_checkpointing,
        apply_activation_checkpointing,
    )
    _ENTRY_POINTS += [(_tcw, "checkpoint_wrapper"), (_tcw, "apply_activation_checkpointing")]
#: forwarding function -> torch's function it replaces.
_ORIGINALS: dict[int, tuple[Callable, Callable]] = {id(new): (new, old) for old, new in _REPLACEMENTS.values()}

_pinned: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _redirect(fn: Any) -> Any:
    """``fn`` with the torch functions it leads to replaced by sac2's (see the module docstring)."""
    hit = _REPLACEMENTS.get(id(fn))
    if hit is not None and hit[0] is fn:
        return hit[1]
    if isinstance(fn, functools.partial):
        func = _redirect(fn.func)
        args = tuple(_redirect(a) if callable(a) else a for a in fn.args)
        keywords = {k: _redirect(v) if callable(v) else v for k, v in fn.keywords.items()}
        if func is fn.func and all(a is b for a, b in zip(args, fn.args)) and all(
            keywords[k] is fn.keywords[k] for k in keywords
        ):
            return fn
        return functools.partial(func, *args, **keywords)
    if isinstance(fn, types.FunctionType):
        return _pin_globals(fn)
    return fn


def _pin_globals(fn: types.FunctionType) -> types.FunctionType:
    """``fn``, or a copy of it whose globals bind each global name it uses that means a torch checkpoint function
    (or its forwarding function) to the forwarding function for good."""
    cached = _pinned.get(fn)
    if cached is not None:
        return cached
    g = fn.__globals__
    names = {}
    for name in fn.__code__.co_names:
        value = g.get(name)
        hit = _REPLACEMENTS.get(id(value))
        if hit is not None and hit[0] is value:
            names[name] = hit[1]
        elif id(value) in _ORIGINALS and _ORIGINALS[id(value)][0] is value:
            names[name] = value
    if not names:
        return fn
    pinned = types.FunctionType(fn.__code__, {**g, **names}, fn.__name__, fn.__defaults__, fn.__closure__)
    pinned.__kwdefaults__ = fn.__kwdefaults__
    pinned.__qualname__ = fn.__qualname__
    pinned.__dict__.update(fn.__dict__)
    _pinned[fn] = pinned
    return pinned


def _client_namespaces() -> Iterator[tuple[str, dict]]:
    """(module name, module dict) of every imported module outside torch and sac2."""
    for name, module in list(sys.modules.items()):
        if module is None or name in ("torch", "sac2") or name.startswith(("torch.", "sac2.")):
            continue
        try:
            namespace = object.__getattribute__(module, "__dict__")
        except Exception:
            continue
        if isinstance(namespace, dict):
            yield name, namespace


def _bindings() -> Iterator[tuple[str, dict, str, Any]]:
    """(qualified name, namespace, name, value) of every binding of a torch checkpoint function or its
    forwarding function: torch's public entry points first, then the client modules'."""
    for module, attr in _ENTRY_POINTS:
        yield f"{module.__name__}.{attr}", module.__dict__, attr, module.__dict__.get(attr)
    for modname, namespace in _client_namespaces():
        for attr, value in list(namespace.items()):
            key = id(value)
            if (key in _REPLACEMENTS and _REPLACEMENTS[key][0] is value) or (
                key in _ORIGINALS and _ORIGINALS[key][0] is value
            ):
                yield f"{modname}.{attr}", namespace, attr, value


def installed() -> dict[str, str]:
    """Where each binding of torch's checkpoint functions points now: ``{"module.name": "sac2" or "torch"}``.

    Covers torch's public entry points and every imported module outside torch and sac2 that binds one of them
    (e.g. ``transformers.modeling_utils.checkpoint``, ``torchtitan.distributed.activation_checkpoint.
    ptd_checkpoint_wrapper``). With sac2 installed every value is ``"sac2"``.
    """
    return {qualname: "sac2" if id(value) in _ORIGINALS else "torch" for qualname, _, _, value in _bindings()}


_active: list["Installation"] = []
_lock = threading.Lock()


class Installation:
    """The handle ``install()`` returns: ``verify()`` checks it, ``uninstall()`` (or leaving ``with``) undoes it.

    ``rebound`` names every binding this installation changed from torch's function to sac2's.
    """

    def __init__(self) -> None:
        self.rebound: tuple[str, ...] = ()
        self.active = False

    def _install(self) -> None:
        with _lock:
            rebound = []
            for qualname, namespace, attr, value in list(_bindings()):
                hit = _REPLACEMENTS.get(id(value))
                if hit is not None and hit[0] is value:
                    namespace[attr] = hit[1]
                    rebound.append(qualname)
            self.rebound = tuple(rebound)
            self.active = True
            _active.append(self)

    def verify(self) -> dict[str, str]:
        """``installed()``, after checking that this installation is in effect and that no binding points at
        torch's functions; raises ``RuntimeError`` naming them otherwise."""
        if not self.active:
            raise RuntimeError("sac2.integrations.install: this installation was uninstalled.")
        report = installed()
        torch_bound = sorted(k for k, v in report.items() if v == "torch")
        if torch_bound:
            raise RuntimeError(
                "sac2.integrations.install: these names still run torch's activation checkpointing, not sac2's: "
                f"{torch_bound}. Something rebound them after install(); call install() again."
            )
        return report

    def uninstall(self) -> None:
        """Undo the installation. When the last active one goes, torch's function is put back in every module
        binding that holds a forwarding function of sac2's (the rebound ones and those imported since)."""
        with _lock:
            if not self.active:
                return
            self.active = False
            _active.remove(self)
            if _active:
                return
            for _, namespace, attr, value in list(_bindings()):
                hit = _ORIGINALS.get(id(value))
                if hit is not None and hit[0] is value:
                    namespace[attr] = hit[1]

    def __enter__(self) -> "Installation":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.uninstall()

    def __repr__(self) -> str:
        state = "active" if self.active else "uninstalled"
        return f"<sac2 Installation {state}, {len(self.rebound)} bindings rebound>"


def install() -> Installation:
    """Run sac2's checkpoint and modes wherever torch's checkpoint API is called, until ``uninstall()``.

    Use it for a whole run, before the framework enables checkpointing::

        handle = sac2.integrations.install()
        model.gradient_checkpointing_enable(...)   # or Trainer(...).train(), SelectiveAC(...).apply(model)
        handle.verify()

    or as a context manager (``with sac2.integrations.install(): ...``). Installations nest; torch's functions come
    back when the last one is uninstalled.
    """
    handle = Installation()
    handle._install()
    return handle

