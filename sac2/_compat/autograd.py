"""torch's autograd internals sac2's frame needs: saved-tensor hooks and ``SavedTensor``, graph tasks, grad mode,
the running node, and the version counters of saved tensors. The state a recompute replays (RNG, autocast, device
context) is ``recompute_state``'s.

Each shim names, in a ``Removable:`` line, the torch change that would let it go. They all hold on torch 2.13-2.15.
"""

from __future__ import annotations

import functools
import operator
from typing import Any, Callable, TypeAlias

import torch
import torch.utils.checkpoint as _tuc

from sac2._compat.dispatch import mode_stack_len

__all__ = [
    "noop_context_fn", "backward_keeps_graph", "in_checkpoint_forward", "user_saved_tensors_hooks",
    "make_saved_tensor", "unpack_saved_tensor", "as_is", "graph_exec_group", "graph_task_id", "graph_task",
    "push_checkpoint_hooks",
    "pop_checkpoint_hooks", "set_grad_enabled", "current_node_name", "mutation_on_saved_tensors_allowed",
    "version_witness", "checkpoint_forward_hooks", "top_saved_tensors_hooks", "view_base", "parameter_of",
    "push_saved_tensors_hooks", "pop_saved_tensors_hooks", "HookPair", "SavedTensor", "sequence_nr",
    "node_sequence_nr",
]

#: A (pack, unpack) pair of saved-tensor hooks: pack turns a tensor into anything, unpack turns that back.
HookPair: TypeAlias = tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]]


#: torch's "no context" sentinel: dynamo recognises exactly this object as "no selective policy".
# Removable: never: torch's public sentinel, kept here beside the frame's other checkpoint facts.
noop_context_fn = _tuc.noop_context_fn


def backward_keeps_graph() -> bool:
    """Whether the running backward was asked to keep its graph (``retain_graph=True``): then a later backward
    can recompute the same region again, so what recompute serves must stay in the record.

    Removable: autograd exposes the running graph task's keep_graph publicly.
    """
    return torch._C._autograd._get_current_graph_task_keep_graph()

#: The code of the pack hook torch's non-reentrant checkpoint pushes for its forward (``_checkpoint_hook``).
_CHECKPOINT_PACK = next(
    (c for c in _tuc._checkpoint_hook.__init__.__code__.co_consts if getattr(c, "co_name", None) == "pack_hook"), None
)


def in_checkpoint_forward() -> bool:
    """Whether this thread runs inside the forward of a non-reentrant checkpoint (sac2's frame, torch's: HF's,
    torch's wrappers): the innermost saved-tensor hooks are that checkpoint's. Hooks pushed inside it
    (``save_on_cpu``) hide it; its recompute in backward pushes other hooks, so does not count.

    Removable: torch marks its checkpoint hooks publicly (2.14+ has ``_checkpoint_internal``, still private).
    """
    return _is_checkpoint_forward(_top_hooks())


def _is_checkpoint_forward(hooks: HookPair | None) -> bool:
    if hooks is None:
        return False
    if getattr(hooks[0], "_sac2_forward", False):
        return True
    return _CHECKPOINT_PACK is not None and getattr(hooks[0], "__code__", None) is _CHECKPOINT_PACK


def user_saved_tensors_hooks() -> HookPair | None:
    """The (pack, unpack) pair a tensor saved for backward right now would go through, or None, looking past the
    hooks checkpoints push themselves (an outer checkpoint's placeholders, its recompute's capture) to the user's.

    Checkpoint-internal hooks (sac2's frame's, torch 2.14+'s) keep the pair beneath them as ``_user_hooks`` while on
    the stack; torch 2.13's are recognised by the module that defines them, and the pair beneath is read by popping
    them for a moment. Either way nested checkpoints resolve to the hooks the user pushed.

    Removable: ``torch.utils.checkpoint`` exposes the user's saved-tensor hooks beneath its own (2.14+: private).
    """
    hooks = _top_hooks()
    while hooks is not None and _checkpoint_internal(hooks):
        pack = hooks[0]
        if not hasattr(pack, "_user_hooks"):
            return _beneath_torch_hooks()
        hooks = pack._user_hooks
    return hooks


def _beneath_torch_hooks() -> HookPair | None:
    """torch 2.13: the first hook pair beneath the checkpoint-internal ones on top of the stack, found by popping
    them and pushing them back."""
    if not _hooks_enabled():
        return None  # hooks can't be pushed back now; under disable_saved_tensors_hooks nothing may be saved
    popped: list[HookPair] = []
    hooks = _top_hooks()
    try:
        while hooks is not None and _checkpoint_internal(hooks):
            popped.append(hooks)
            _pop_hooks()
            hooks = _top_hooks()
    finally:
        for pack, unpack in reversed(popped):
            _push_hooks(pack, unpack)
    return hooks


def _checkpoint_internal(hooks: HookPair) -> bool:
    """Whether a hook pair is one torch's non-reentrant checkpoint pushed (torch 2.13: its unpack hooks are local
    functions of ``torch.utils.checkpoint``; its pack hook may be wrapped by ``torch._dynamo.disable``)."""
    internal = getattr(hooks[0], "_checkpoint_internal", False)
    return bool(internal) or getattr(hooks[1], "__module__", None) == _tuc.__name__


SavedTensor = torch._C._autograd.SavedTensor
_make_saved_tensor = torch._C._autograd._make_saved_tensor
_push_hooks = torch._C._autograd._push_saved_tensors_default_hooks
_pop_hooks = torch._C._autograd._pop_saved_tensors_default_hooks
_top_default_hooks = torch._C._autograd._top_saved_tensors_default_hooks
#: The innermost saved-tensor hook pair, None when none is pushed (torch's stubs leave out the None).
_top_hooks: Callable[[], HookPair | None] = functools.partial(_top_default_hooks, False)
# Present on torch 2.13-2.15, missing from their stubs.
_hooks_enabled: Callable[[], bool] = torch._C._autograd._saved_tensors_hooks_is_enabled  # type: ignore[attr-defined]
_graph_task_id = torch._C._current_graph_task_id
_graph_exec_group = torch._C._get_graph_exec_group
_grad_enabled = torch.is_grad_enabled
_set_grad = torch._C._set_grad_enabled


def make_saved_tensor(t: torch.Tensor) -> SavedTensor:
    """Save ``t`` as autograd saves an input of a node: through the saved-tensor hooks in effect.

    Removable: ``torch._C._autograd._make_saved_tensor`` becomes public.
    """
    return _make_saved_tensor(t, is_output=False)


def unpack_saved_tensor(x: object) -> object:
    """The tensor a ``SavedTensor`` holds; any other argument as it is."""
    return x.unpack() if type(x) is SavedTensor else x


#: ``graph_exec_group()``: the ``GraphExecGroup`` in effect, or None; ``graph_task_id()``: the running backward's graph
#: task id, -1 outside any backward. torch's own calls, bound (no Python frame: the frame's unpack reads them per
#: tensor). Removable: graph tasks and ``GraphExecGroup``'s current group get public accessors.
graph_exec_group: Callable[[], _tuc.GraphExecGroup | None] = _graph_exec_group
graph_task_id: Callable[[], int] = _graph_task_id


def graph_task() -> _tuc.GraphExecGroup | int | None:
    """What a recompute is shared by: the ``GraphExecGroup`` in effect, else the running backward's graph task; None
    outside any backward.

    Removable: graph tasks and ``GraphExecGroup``'s current group get public accessors.
    """
    group = _graph_exec_group()
    if group is not None:
        return group
    gid = _graph_task_id()
    return None if gid == -1 else gid


def push_checkpoint_hooks(
    pack: Callable[[torch.Tensor], Any], unpack: Callable[[Any], torch.Tensor], forward: bool = False
) -> None:
    """Push a checkpoint's saved-tensor hooks, marked as checkpoint-internal the way torch 2.14+ marks its own
    (``_checkpoint_internal``, and ``_user_hooks``, the user's pair beneath, while on the stack), so that torch's
    SAC, sac2's and nested checkpoints find the user's hooks past them.

    Removable: saved-tensor hooks can be pushed and popped without a context manager publicly.
    """
    # Marks on the function object, as torch 2.14+ marks its own hooks: mypy knows no attributes of a Callable.
    pack._checkpoint_internal = True  # type: ignore[attr-defined]
    pack._sac2_forward = forward  # type: ignore[attr-defined]
    pack._user_hooks = user_saved_tensors_hooks()  # type: ignore[attr-defined]
    _push_hooks(pack, unpack)


def push_saved_tensors_hooks(pack: Callable[[torch.Tensor], Any], unpack: Callable[[Any], torch.Tensor]) -> None:
    """Push a saved-tensor hook pair, as entering ``torch.autograd.graph.saved_tensors_hooks`` does, without the
    context manager's three Python calls (a saved region's body runs under its own pair on every call).

    Removable: saved-tensor hooks can be pushed and popped without a context manager publicly.
    """
    _push_hooks(pack, unpack)


def pop_saved_tensors_hooks() -> None:
    """Pop the innermost saved-tensor hook pair (``push_saved_tensors_hooks``)."""
    _pop_hooks()


def pop_checkpoint_hooks(pack: Callable[[torch.Tensor], Any]) -> None:
    _pop_hooks()
    del pack._user_hooks  # type: ignore[attr-defined]  # the graph keeps the hooks, but not the user's through them


#: ``sequence_nr()``: the sequence number the next autograd node this thread makes will get (each node a thread
#: makes gets the next one). Two readings bracket the nodes made between them, so a checkpoint's forward knows which
#: nodes are its own. Removable: autograd exposes the thread's sequence number publicly.
sequence_nr: Callable[[], int] = torch._C._autograd._get_sequence_nr


def node_sequence_nr(node: Any) -> int:
    """The sequence number of an autograd node (a tensor's ``grad_fn``): its place among the nodes its thread made.

    Removable: ``Node._sequence_nr`` becomes public.
    """
    return int(node._sequence_nr())


def current_node_name() -> str | None:
    """The name of the autograd node the engine is running (``MmBackward0``), or None outside a backward.

    Removable: torch exposes the running node publicly.
    """
    node: Any = torch._C._current_autograd_node()  # None outside a backward, whatever the stubs say
    return None if node is None else str(node.name())


#: ``version_witness``'s storage-less tensors (the witness keeps the dtype: its type()), by dtype on CPU, else by
#: (device, dtype).
_EMPTY: dict[torch.dtype | tuple[torch.device, torch.dtype], torch.Tensor] = {}
_DisableTorchDispatch = torch._C._DisableTorchDispatch


def as_is(t: torch.Tensor) -> torch.Tensor:
    """The saved-tensor hook that keeps a tensor as it is: as a pack hook, autograd keeps the tensor itself (no
    checkpoint beneath sees it); as an unpack hook, it hands back what the pack hook kept.

    Removable: never (not a torch internal; here beside the hooks it is passed with).
    """
    return t


def version_witness(t: torch.Tensor) -> torch.Tensor | None:
    """A tensor that shares ``t``'s version counter and nothing else (no storage, no autograd history), so that
    in-place writes into ``t`` show after ``t`` itself is gone; None where one cannot be made (tensor subclasses,
    non-strided layouts): there the caller watches ``t`` weakly. One per saved tensor: the common case (no mode on
    the stack, an ``empty`` of its kind made) is two C calls.

    Removable: torch exposes a tensor's version counter as an object.
    """
    if type(t) is not torch.Tensor:
        return None
    key = t.dtype if t.is_cpu else (t.device, t.dtype)  # no device object on CPU
    empty = _EMPTY.get(key)
    if mode_stack_len() or empty is None:  # one witness per saved tensor: the context only where a mode is
        with _DisableTorchDispatch():  # nothing here is an op of the user's program: no mode is to see it
            if empty is None:
                empty = _EMPTY[key] = torch.empty(0, device=t.device, dtype=t.dtype)
            w = t.detach()
    else:
        w = t.detach()
    try:
        w.data = empty  # set_data: new storage and sizes, same version counter, no version bump
    except RuntimeError:  # a tensor type set_data refuses to mix with a strided one (sparse, nested, mkldnn, ...)
        return None
    return w


def mutation_on_saved_tensors_allowed() -> bool:
    """Whether ``torch.autograd.graph.allow_mutation_on_saved_tensors()`` is in effect.

    Removable: torch exposes whether the context is active.
    """
    return bool(getattr(torch.autograd.graph, "_allow_mutation_on_saved_tensors_enabled", False))


def set_grad_enabled(enabled: bool) -> bool:
    """Set grad mode; return the previous one.

    Removable: never: ``torch._C._set_grad_enabled`` is what ``torch.set_grad_enabled`` calls, minus an object.
    """
    was = _grad_enabled()
    _set_grad(enabled)
    return was


def checkpoint_forward_hooks() -> HookPair | None:
    """The (pack, unpack) pair of the checkpoint whose forward runs right now (sac2's frame or torch's), when it is
    the innermost saved-tensor hook pair; None otherwise. A saved region hands it the tensors its body saves that
    are (views of) its own inputs, so the checkpoint keeps a position for them instead of the tensor.

    Removable: torch exposes the innermost saved-tensor hooks publicly (``_top_saved_tensors_default_hooks``).
    """
    hooks = _top_hooks()
    return hooks if _is_checkpoint_forward(hooks) else None


#: ``top_saved_tensors_hooks()``: the innermost saved-tensor hook pair, or None; in a checkpoint's recompute, its
#: recompute hooks. torch's own call, bound (no Python frame). Removable: torch exposes the innermost hooks publicly.
top_saved_tensors_hooks: Callable[[], HookPair | None] = _top_hooks


#: ``view_base(t)``: the tensor ``t`` is a view of (the root of a chain of views), or None when ``t`` is no view.
#: An attribute getter: no Python frame on the per-save path. Removable: never (``Tensor._base`` is torch's name).
view_base: Callable[[torch.Tensor], torch.Tensor | None] = operator.attrgetter("_base")


def parameter_of(t: torch.Tensor) -> torch.Tensor | None:
    """The leaf that requires grad (a parameter) ``t`` is or views, else None: memory from before a forward.

    Removable: never: ``Tensor._base`` is how torch names a view's base.
    """
    root = t if t._base is None else t._base
    return root if root.is_leaf and root.requires_grad else None
