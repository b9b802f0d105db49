"""Changing what a module's calls do without a wrapper: swap its class for a subclass with another ``forward``.

``checkpoint_module`` (``Checkpointed<Name>``) and module regions (``Region<Name>``) both change a module in place
this way, so parameter names, state-dict keys, hooks, ``isinstance`` and FSDP's own class swap stay as they were.
The subclass is made at run time, once per (class, kind): pickle cannot find it by name, so an instance pickles as
"the subclass of that kind of ``cls``" with its ``__dict__``, and loading makes or finds that class again.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

__all__ = ["register_kind", "swap_class", "restore_class", "is_kind"]

#: kind (the class-name prefix) -> the forward its subclasses get, ``forward(self, parent_forward, *args, **kwargs)``,
#: and whether ``parent_forward`` is bound to the module (else the class's function, called with the module first).
_kinds: dict[str, tuple[Callable[..., Any], bool]] = {}
_classes: dict[tuple[type, str], type] = {}


def register_kind(kind: str, forward: Callable[..., Any], bound: bool = True) -> None:
    """Declare a kind of subclass: ``forward(module, parent_forward, *args, **kwargs)`` replaces the forward, given
    the parent class's forward bound to the module, or (``bound=False``) the function itself. Where dynamo breaks the
    graph inside the call it rebuilds a bound method by its name on the module, which names this replacement, not
    the parent's: a kind whose call may break the graph (a checkpoint) takes the function."""
    _kinds[kind] = (forward, bound)


def _subclass(cls: type[nn.Module], kind: str) -> type:
    found = _classes.get((cls, kind))
    if found is not None:
        return found
    wrap, bound = _kinds[kind]
    new: type  # made below, before any call of forward

    def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        # The parent's forward read from ``cls``, a closure cell dynamo guards once per class, not through
        # ``super()``, whose MRO walk it guards on every instance.
        return wrap(self, cls.forward.__get__(self, new) if bound else cls.forward, *args, **kwargs)

    def __reduce_ex__(
        self: nn.Module, _protocol: int
    ) -> tuple[Callable[[type, str], nn.Module], tuple[type, str], dict[str, Any]]:
        return _new_instance, (cls, kind), self.__dict__

    body = {"forward": forward, "__reduce_ex__": __reduce_ex__, "__module__": cls.__module__}
    new = type(f"{kind}{cls.__name__}", (cls,), body)
    new.__qualname__ = f"{kind}{cls.__qualname__}"
    _classes[(cls, kind)] = new
    return new


def _new_instance(cls: type, kind: str) -> nn.Module:
    """An empty instance of the ``kind`` subclass of ``cls``, for pickle to fill with the state it saved."""
    return object.__new__(_subclass(cls, kind))


def swap_class(module: nn.Module, kind: str) -> None:
    """Make ``module`` an instance of the ``kind`` subclass of its class (still an instance of its class)."""
    module.__class__ = _subclass(type(module), kind)


def restore_class(module: nn.Module, kind: str) -> None:
    """Undo ``swap_class(module, kind)``: a ``kind`` subclass's instance becomes one of its class again (a no-op
    for any other module)."""
    if is_kind(module, kind):
        module.__class__ = type(module).__mro__[1]


def is_kind(module: nn.Module, kind: str) -> bool:
    """Whether ``module``'s class is a ``kind`` subclass made here."""
    return _classes.get((type(module).__mro__[1], kind)) is type(module) if len(type(module).__mro__) > 1 else False
