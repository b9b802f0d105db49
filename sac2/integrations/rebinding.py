"""``install()``: code that calls torch's checkpoint API runs sac2, without editing that code.

torch's ``checkpoint`` function stays exactly torch's: its signature, its defaults and warnings, its reentrant
path, and its identity, which torch.compile's dynamo special-cases (``torch.utils.checkpoint.checkpoint`` becomes
the ``tag_activation_checkpoint`` HOP; a fullgraph compile of torch's own ``CheckpointWrapper`` depends on it).
What ``install()`` swaps is what sac2 changes, underneath that API:

- the eager non-reentrant frame: torch's ``checkpoint`` (and the composable ``checkpoint(module)``) call a
  generator module global for it, which ``install()`` points at sac2's frame (``sac2.frame.entry.frames``). Under
  torch.compile, export or FX tracing sac2's frame hands over to torch's own, so compiled code is unchanged;
- ``create_selective_checkpoint_contexts``: torch's public name, and every name in an imported module outside
  torch and sac2 that *is* torch's function (``sys.modules`` is scanned, so a module that bound it under another
  name at import time is found too), now make sac2's modes;
- ``checkpoint_wrapper`` and ``apply_activation_checkpointing`` (torch's public names and their copies in client
  modules) build sac2's wrappers, whose ``context_fn`` keeps sac2's contexts after ``uninstall()``: a plain function
  such as torchtitan's ``lambda: create_selective_checkpoint_contexts(policy)`` looks the name up in its module on
  every call, so the wrapper keeps a copy of it whose globals bind that name to sac2's for good.

- under torch.compile, dynamo's setting that lets a checkpoint's body keep its Python side effects (torch's
  ``skip_fwd_side_effects_in_bwd_under_checkpoint``), as sac2's own checkpoints always do
  (``sac2.api.checkpointing``): a checkpointed layer that sets and resets an outside object on every call
  (transformers 5.25's attention) compiles in one graph under HF's own ``gradient_checkpointing_enable``, the change
  applied once per call as without checkpointing, instead of breaking the graph and running the layer eagerly.

``uninstall()`` (or leaving the ``with`` block) puts torch's objects back everywhere, in modules imported since
``install()`` too, and dynamo's setting as it was. Code that still calls torch's ``checkpoint`` then runs torch's
frame again; sac2 wrappers built while installed keep running sac2.
"""

from __future__ import annotations

import functools
import sys
import threading
import types
import weakref
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch.utils.checkpoint as _tuc
from torch import nn

from sac2 import _compat, messages
from sac2.api.checkpointing import create_selective_checkpoint_contexts as _sac2_contexts
from sac2.api.wrappers import CheckpointImpl
from sac2.api.wrappers import apply_activation_checkpointing as _sac2_apply
from sac2.api.wrappers import checkpoint_wrapper as _sac2_wrapper
from sac2.core.decisions import Policy
from sac2.frame import entry
from sac2.modes.forward import CachingMode
from sac2.modes.replay import ReplayMode
from sac2.record.regions import RegionForward, RegionReplay

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = [
    "install",
    "installed",
    "Installation",
    "create_selective_checkpoint_contexts",
    "checkpoint_wrapper",
    "apply_activation_checkpointing",
]

_TORCH_CONTEXTS = _tuc.create_selective_checkpoint_contexts


def create_selective_checkpoint_contexts(
    policy_fn_or_list: Policy, allow_cache_entry_mutation: bool = False
) -> tuple[CachingMode | RegionForward, ReplayMode | RegionReplay]:
    """What torch's ``create_selective_checkpoint_contexts`` is while sac2 is installed: sac2's."""
    return _sac2_contexts(policy_fn_or_list, allow_cache_entry_mutation)


def checkpoint_wrapper(
    module: nn.Module,
    checkpoint_impl: CheckpointImpl = CheckpointImpl.NO_REENTRANT,
    checkpoint_fn: Callable[..., Any] | None = None,
    **checkpoint_fn_kwargs: Any,
) -> nn.Module:
    """What torch's ``checkpoint_wrapper`` is while sac2 is installed: ``sac2.checkpoint_wrapper``."""
    if checkpoint_fn is not None:
        checkpoint_fn = _redirect(checkpoint_fn)
    if "context_fn" in checkpoint_fn_kwargs:
        checkpoint_fn_kwargs["context_fn"] = _redirect(checkpoint_fn_kwargs["context_fn"])
    return _sac2_wrapper(module, checkpoint_impl, checkpoint_fn, **checkpoint_fn_kwargs)


def apply_activation_checkpointing(
    model: nn.Module,
    checkpoint_wrapper_fn: Callable[..., nn.Module] = checkpoint_wrapper,
    check_fn: Callable[[nn.Module], bool] = lambda _: True,
    auto_wrap_policy: Callable[..., bool] | object = None,
) -> None:
    """What torch's ``apply_activation_checkpointing`` is while sac2 is installed: sac2's."""
    _sac2_apply(model, _redirect(checkpoint_wrapper_fn), check_fn, auto_wrap_policy)


def _frames(
    function: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], **options: Unpack[_compat.FrameOptions]
) -> _compat.FrameGenerator:
    """sac2's frame, for torch's ``checkpoint``: a ``context_fn`` that leads to torch's contexts gets sac2's."""
    options["context_fn"] = _redirect(options["context_fn"])
    return entry.frames(function, args, kwargs, **options)


#: sac2's frame in the calling convention of torch's frame generator on this torch.
_FRAME = _compat.as_torch_frame(_frames)

#: torch's function -> its replacement, for the functions client modules may bind.
_REPLACEMENTS: dict[int, tuple[Callable[..., Any], Callable[..., Any]]] = {
    id(_TORCH_CONTEXTS): (_TORCH_CONTEXTS, create_selective_checkpoint_contexts),
}
#: (module, attribute) of torch's own bindings: the public entry points and the frame generator's callers.
_ENTRY_POINTS: list[tuple[types.ModuleType, str]] = [(_tuc, "create_selective_checkpoint_contexts")]
for _module, _attr in _compat.torch_frame_bindings():
    _REPLACEMENTS.setdefault(id(_compat.TORCH_FRAME), (_compat.TORCH_FRAME, _FRAME))
    _ENTRY_POINTS.append((_module, _attr))
for _name, _ours in (("checkpoint_wrapper", checkpoint_wrapper),
                     ("apply_activation_checkpointing", apply_activation_checkpointing)):
    _theirs = _compat.torch_wrapper_function(_name)
    if _theirs is not None:
        _REPLACEMENTS[id(_theirs)] = (_theirs, _ours)
        _ENTRY_POINTS.append((sys.modules[_theirs.__module__], _name))
#: replacement -> torch's object it replaces.
_ORIGINALS: dict[int, tuple[Callable[..., Any], Callable[..., Any]]] = {
    id(new): (new, old) for old, new in _REPLACEMENTS.values()
}
#: The functions client modules bind (the frame generator is torch's business only).
_CLIENT_FUNCTIONS = frozenset(k for k, (old, _) in _REPLACEMENTS.items() if old is not _compat.TORCH_FRAME)

_pinned: weakref.WeakKeyDictionary[types.FunctionType, types.FunctionType] = weakref.WeakKeyDictionary()


def _redirect(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` with the torch functions it leads to replaced by sac2's (see the module docstring)."""
    hit = _REPLACEMENTS.get(id(fn))
    if hit is not None and hit[0] is fn:
        return hit[1]
    if isinstance(fn, functools.partial):
        func = _redirect(fn.func)
        args = tuple(_redirect(a) if callable(a) else a for a in fn.args)
        keywords = {k: _redirect(v) if callable(v) else v for k, v in fn.keywords.items()}
        if func is fn.func and all(a is b for a, b in zip(args, fn.args, strict=True)) and all(
            keywords[k] is fn.keywords[k] for k in keywords
        ):
            return fn
        return functools.partial(func, *args, **keywords)
    if isinstance(fn, types.FunctionType):
        return _pin_globals(fn)
    return fn


def _pin_globals(fn: types.FunctionType) -> types.FunctionType:
    """``fn``, or a copy of it whose globals bind each global name it uses that means a torch checkpoint function
    (or its replacement) to the replacement for good."""
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


def _client_namespaces() -> Iterator[tuple[str, dict[str, Any]]]:
    """(module name, module dict) of every imported module outside torch and sac2."""
    for name, module in list(sys.modules.items()):
        if module is None:  # an import blocked on purpose (typeshed types sys.modules' values as modules only)
            continue  # type: ignore[unreachable]
        if name in ("torch", "sac2") or name.startswith(("torch.", "sac2.")):
            continue
        try:
            namespace = object.__getattribute__(module, "__dict__")
        except Exception:
            continue
        if isinstance(namespace, dict):
            yield name, namespace


def _is(table: dict[int, tuple[Callable[..., Any], Callable[..., Any]]], value: object) -> bool:
    hit = table.get(id(value))
    return hit is not None and hit[0] is value


def _bindings() -> Iterator[tuple[str, dict[str, Any], str, object]]:
    """(qualified name, namespace, name, value) of every binding of a torch object ``install()`` replaces, or of
    its replacement: torch's own bindings first, then the client modules'."""
    for module, attr in _ENTRY_POINTS:
        yield f"{module.__name__}.{attr}", module.__dict__, attr, module.__dict__.get(attr)
    for modname, namespace in _client_namespaces():
        for attr, value in list(namespace.items()):
            key = id(value)
            if (key in _CLIENT_FUNCTIONS and _is(_REPLACEMENTS, value)) or (
                _is(_ORIGINALS, value) and id(_ORIGINALS[key][1]) in _CLIENT_FUNCTIONS
            ):
                yield f"{modname}.{attr}", namespace, attr, value


def installed() -> dict[str, str]:
    """Where each binding ``install()`` manages points now: ``{"module.name": "sac2" or "torch"}``.

    Covers torch's frame generator (``torch.utils.checkpoint._checkpoint_without_reentrant_generator...``) and its
    public ``create_selective_checkpoint_contexts``, ``checkpoint_wrapper`` and ``apply_activation_checkpointing``,
    and every imported module outside torch and sac2 that binds one of those three functions (e.g.
    ``torchtitan.distributed.activation_checkpoint.ptd_checkpoint_wrapper``). With sac2 installed every value is
    ``"sac2"``.

    Returns:
        A dict from each binding's qualified name to ``"sac2"`` or ``"torch"``.
    """
    return {qualname: "sac2" if id(value) in _ORIGINALS else "torch" for qualname, _, _, value in _bindings()}


_active: list[Installation] = []
_lock = threading.Lock()
#: dynamo's setting for side effects in checkpoints before the first active installation set it (``_install``).
_side_effects_kept_before = False


class Installation:
    """The handle ``install()`` returns: ``verify()`` checks it, ``uninstall()`` (or leaving ``with``) undoes it.

    ``rebound`` names every binding this installation changed from torch's object to sac2's.
    """

    def __init__(self) -> None:
        self.rebound: tuple[str, ...] = ()
        self.active = False

    def _install(self) -> None:
        global _side_effects_kept_before
        with _lock:
            if not _active:
                _side_effects_kept_before = _compat.keep_checkpoint_side_effects(True)
            rebound = []
            for qualname, namespace, attr, value in list(_bindings()):
                if _is(_REPLACEMENTS, value):
                    namespace[attr] = _REPLACEMENTS[id(value)][1]
                    rebound.append(qualname)
            self.rebound = tuple(rebound)
            self.active = True
            _active.append(self)

    def verify(self) -> dict[str, str]:
        """``installed()``, after checking that this installation is in effect and that no binding points at
        torch's objects; raises ``RuntimeError`` naming them otherwise."""
        if not self.active:
            raise RuntimeError(messages.INSTALL_UNINSTALLED)
        report = installed()
        torch_bound = sorted(k for k, v in report.items() if v == "torch")
        if torch_bound:
            raise RuntimeError(messages.install_rebound(torch_bound))
        return report

    def uninstall(self) -> None:
        """Undo the installation. When the last active one goes, torch's object is put back in every binding that
        holds sac2's replacement (the rebound ones and those made since)."""
        with _lock:
            if not self.active:
                return
            self.active = False
            _active.remove(self)
            if _active:
                return
            _compat.keep_checkpoint_side_effects(_side_effects_kept_before)
            for _, namespace, attr, value in list(_bindings()):
                if _is(_ORIGINALS, value):
                    namespace[attr] = _ORIGINALS[id(value)][1]

    def __enter__(self) -> Installation:
        return self

    def __exit__(self, *exc: object) -> None:
        self.uninstall()

    def __repr__(self) -> str:
        state = "active" if self.active else "uninstalled"
        return f"<sac2 Installation {state}, {len(self.rebound)} bindings rebound>"


def install() -> Installation:
    """Run sac2's frame and modes wherever torch's checkpoint API is called, until ``uninstall()``.

    Use it for a whole run, before the framework enables checkpointing::

        handle = sac2.install()
        model.gradient_checkpointing_enable(...)   # or Trainer(...).train(), SelectiveAC(...).apply(model)
        handle.verify()

    or as a context manager (``with sac2.install(): ...``). Installations nest; torch's objects come back when the
    last one is uninstalled. Frameworks that call torch's checkpoint API (transformers, torchtitan, Lightning)
    then run sac2 without a change to their code; ``docs/concepts.md`` says why it rebinds the frame, not torch's
    ``checkpoint``. Under torch.compile, a checkpointed function's changes to Python objects from outside it (such
    as a context variable set and reset around each call) stay in the compiled graph, applied once per call as
    without checkpointing, where stock torch breaks the graph and runs the checkpoint eagerly; sac2's own
    ``checkpoint`` and wrappers do so whether installed or not.

    Returns:
        The ``Installation`` handle: ``verify()`` checks that it is still in effect and that every binding
        points at sac2 (raising ``RuntimeError`` otherwise, naming the bindings that do not), ``uninstall()`` or
        leaving its ``with`` block undoes it.
    """
    handle = Installation()
    handle._install()
    return handle
