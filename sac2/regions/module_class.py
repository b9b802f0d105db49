"""Changing what a module's calls do without a wrapper: swap its class for a subclass with another ``forward``.

``checkpoint_module`` (``Checkpointed<Name>``) and module regions (``Region<Name>``) both change a module in place
this way, so parameter names, state-dict keys, hooks, ``isinstance`` and FSDP's own class swap stay as they were.
The subclass is made at run time, once per (class, kind): pickle cannot find it by name, so an instance pickles as
"the subclass of that kind of ``cls``" with its ``__dict__``, and loading makes or finds that class again.
"""

from __future__ import annotations

from typing import Any, Callable

from torch import nn

__all__ = ["register_kind", "wrapping", "swap_class", "restore_class", "is_kind"]

#: A kind's maker of forwards: given the class, the forward its subclass gets (``forward(self, *args, **kwargs)``).
MakeForward = Callable[[type[nn.Module]], Callable[..., Any]]
#: kind (the class-name prefix) -> its maker of forwards.
_kinds: dict[str, MakeForward] = {}
_classes: dict[tuple[type, str], type] = {}


def register_kind(kind: str, make_forward: MakeForward) -> None:
    """Declare a kind of subclass: ``make_forward(cls)`` gives the ``forward`` of ``cls``'s subclass, a function
    of the kind's own module (so a call runs no code of this one), reading the parent's from ``cls.forward``."""
    _kinds[kind] = make_forward


def wrapping(wrap: Callable[..., Any], bound: bool = True) -> MakeForward:
    """A maker of forwards for ``register_kind`` from ``wrap(module, parent_forward, *args, **kwargs)``, given the
    parent class's forward bound to the module, or (``bound=False``) the function itself. Where dynamo breaks the
    graph inside the call it rebuilds a bound method by its name on the module, which names this replacement, not
    the parent's: a kind whose call may break the graph (a checkpoint) takes the function."""

    def make_forward(cls: type[nn.Module]) -> Callable[..., Any]:
        def forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
            # The parent's forward read from ``cls``, a closure cell dynamo guards once per class, not through
            # ``super()``, whose MRO walk it guards on every instance.
            return wrap(self, cls.forward.__get__(self) if bound else cls.forward, *args, **kwargs)

        return forward

    return make_forward


def _subclass(cls: type[nn.Module], kind: str) -> type:
    found = _classes.get((cls, kind))
    if found is not None:
        return found
    forward = _kinds[kind](cls)

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
