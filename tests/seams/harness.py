"""How one seam cell runs: the models, each route, policy, execution and backward style, and the reference.

A cell builds its problem (a model, its inputs, its loss, the leaves whose gradients are compared), applies its
policy and route, compiles per its execution, runs its backward style and returns the loss and every gradient,
to compare with the same backward style run without checkpointing. The rules for what a cell must do live in
``tests/seams/matrix.py``; this module only knows how.

Cells sharing a (route, execution, policy) reuse one setup, one after another (``matrix.selected()`` orders
them so): the model is built, wrapped and compiled once and each backward style is a step on it, as training
runs several steps (compiled backward styles that keep the graph get a setup of their own: ``_key``). A setup that
compiles (the whole step, or code inside the blocks: ``compile_inside``) runs one warm-up step when built
(compiling forward and backward); the step a cell checks must then not compile again, and no graph may break (as
under fullgraph), but where a ``falls_back`` rule says the checkpoint runs eagerly, which sac2 must have warned of.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch
import torch._functorch.config
import torch._inductor.config
import torch.nn.functional as F
import torch.utils.checkpoint as tuc
from torch import nn
from torch._dynamo.utils import counters
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

import sac2
from sac2.api import offload_targets
from sac2.core.decisions import CheckpointPolicy, SaveList
from sac2.offload.standin import stand_in
from sac2.regions.in_models import make_regions

from . import torch_style
from .matrix import LIBRARY, Cell
from helpers import WrittenRMSNorm

__all__ = ["Problem", "problem", "reference", "run_cell", "close"]

aten = torch.ops.aten
MATMULS = (aten.mm.default, aten.addmm.default, aten.bmm.default)
D, T, B = 8, 4, 2  # tiny: inductor compiles C++ per kernel on CPU; the seams are in the structure, not the size


# ---- the small model ----


class Attention(nn.Module):
    """Single-head softmax attention written out (bmm, amax, exp, sum, div, bmm). No parameters and a class name
    ending in ``Attention``: ``make_regions``'s ``"attention"`` makes its calls regions."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        s = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
        e = (s - s.amax(-1, keepdim=True)).exp()
        return (e / e.sum(-1, keepdim=True)) @ v


class Block(nn.Module):
    """Pre-norm attention (bias-free Linears: mm) and a GELU-tanh MLP (Linears with bias: addmm), residuals."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = WrittenRMSNorm(D)
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.attention = Attention()
        self.out = nn.Linear(D, D, bias=False)
        self.up = nn.Linear(D, 2 * D)
        self.down = nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.norm(x)).chunk(3, -1)
        x = x + self.out(self.attention(q, k, v))
        return x + self.down(F.gelu(self.up(x), approximate="tanh"))


class Net(nn.Module):
    """Two blocks in ``layers``; ``call(layer, x)``, when set, is how the model calls each block (the function
    routes checkpoint through it); ``activation_input``: the input passes through an op first (offload moves
    activations, not the caller's leaves)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Block(), Block()])
        self.call: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None
        self.activation_input = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.activation_input:
            x = x * 1.0  # bitwise the same: the first block's input an activation, as an embedding gives
        for layer in self.layers:
            x = layer(x) if self.call is None else self.call(layer, x)
        return x


def _small_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return model(x).pow(2).mean()


def _hf_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids, use_cache=False).loss


def _titan_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), ids[:, 1:].flatten())


# ---- problems ----


@dataclass
class Problem:
    """A model, the inputs of its loss, the leaves whose gradients are compared (named), its blocks and the
    Linear that ``compose``'s ``recompute_linears`` names; ``profile`` is (function, inputs) of one block for a
    memory budget."""

    kind: str
    model: Any  # the small model or a transformers one: what a route reads from it (layers, call) differs
    inputs: tuple
    loss: Callable[..., torch.Tensor]
    names: list[str]
    leaves: list[torch.Tensor]
    blocks: list[tuple[str, nn.Module]]
    linear: str
    profile: Callable[[], tuple[Callable, tuple]]
    norms: tuple[str, ...]  # the blocks' norm submodules, whose forward an INSIDE "function" execution compiles


def _small() -> Problem:
    torch.manual_seed(0)
    model = Net()
    x = torch.randn(B, T, D, generator=torch.Generator().manual_seed(1), requires_grad=True)
    named = list(model.named_parameters())
    layer0 = model.layers[0]
    return Problem("small", model, (x,), _small_loss, ["input"] + [n for n, _ in named], [x] + [p for _, p in named],
                   [(f"layers.{i}", m) for i, m in enumerate(model.layers)], "down", lambda: (layer0, (x,)), ("norm",))


def _hf() -> Problem:
    pytest.importorskip(LIBRARY["hf"])
    from clients import tiny_llama, tokens

    model = tiny_llama()
    model.config.use_cache = False
    model.train()
    layers = model.model.layers
    named = list(model.named_parameters())

    def profile() -> tuple[Callable, tuple]:
        """The first decoder layer and its arguments, as a forward of the model calls it."""
        seen: dict[str, Any] = {}

        def hook(_module: nn.Module, args: tuple, kwargs: dict) -> None:
            seen.update(args=args, kwargs=kwargs)

        handle = layers[0].register_forward_pre_hook(hook, with_kwargs=True)
        with torch.no_grad():
            _hf_loss(model, ids)
        handle.remove()
        args = tuple(a.detach().requires_grad_() if isinstance(a, torch.Tensor) else a for a in seen["args"])
        return functools.partial(layers[0], **seen["kwargs"]), args

    ids = tokens()
    return Problem("hf", model, (ids,), _hf_loss, [n for n, _ in named], [p for _, p in named],
                   [(f"model.layers.{i}", m) for i, m in enumerate(layers)], "mlp.down_proj", profile,
                   ("input_layernorm", "post_attention_layernorm"))


def _titan() -> Problem:
    pytest.importorskip(LIBRARY["torchtitan"])
    from clients import titan_model, tokens

    model = titan_model("llama3", layers=2)  # the llama3 debug model's first two blocks, SDPA
    model.train()
    named = list(model.named_parameters())
    ids = tokens(vocab=model.tok_embeddings.num_embeddings, seq=9)
    return Problem("torchtitan", model, (ids,), _titan_loss, [n for n, _ in named], [p for _, p in named],
                   [(f"layers.{n}", m) for n, m in model.layers.named_children()], "feed_forward.w2",
                   lambda: pytest.fail("no budget on the torchtitan route"), ("attention_norm", "ffn_norm"))


_PROBLEMS = {"hf": _hf, "torchtitan": _titan}


def problem(route: str) -> Problem:
    return _PROBLEMS.get(route, _small)()


# ---- policies ----


def _save_matmuls_and_gelu(_ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    if op in MATMULS or op is aten.gelu.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _offload_matmuls(_ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_CPU_OFFLOAD if op in MATMULS else CheckpointPolicy.PREFER_RECOMPUTE


def make_policy(kind: str, p: Problem) -> Any:
    """The policy of ``kind`` for problem ``p`` (None for full AC). ``regions`` makes the blocks' attention and
    Linear calls regions in place and returns their ``Region``s."""
    if kind == "full":
        return None
    if kind == "op_list":
        return list(MATMULS)
    if kind == "policy_fn":
        return _save_matmuls_and_gelu
    if kind == "llm":
        return sac2.policies.llm()
    if kind == "every_other_matmul":
        return sac2.policies.every_other_matmul()
    if kind == "torchtitan":
        return sac2.policies.torchtitan(p.model)
    if kind == "compose":
        return sac2.policies.compose(sac2.policies.recompute_linears(p.model, [p.linear]), sac2.policies.llm())
    if kind == "budget":
        fn, inputs = p.profile()
        return sac2.policies.memory_budget(fn, inputs, 0.5, cost="flops")
    if kind in ("regions", "regions_keep_inputs"):
        regions = make_regions(p.model, p.blocks, ["attention", "linear"])
        return SaveList(regions, keep_inputs=kind == "regions_keep_inputs")  # as apply_ac's own policy
    if kind == "offload":
        return _offload_matmuls
    raise AssertionError(kind)


def offloads(cell: Cell) -> bool:
    """Whether the cell moves something to host memory: it runs through the CPU stand-in for a device."""
    return cell.offload != "none" or cell.policy == "offload"


def _offload_targets(cell: Cell) -> list[str] | None:
    """What ``apply_ac(offload=...)`` names for the cell's ``offload`` (``matrix.OFFLOAD``)."""
    return {"none": None, "regions": ["attention"], "inputs": ["inputs"]}[cell.offload]


def with_offload(cell: Cell, p: Problem, policy: Any) -> Any:
    """``policy`` (None for full AC) with the cell's ``offload`` in host memory, as ``apply_ac(offload=...)``
    builds it for the mode the policy stands for."""
    targets = _offload_targets(cell)
    if targets is None:
        return policy
    moved = offload_targets.Offload("inputs" in targets, tuple(t for t in targets if t != "inputs"), ())
    mode = "full" if policy is None else "regions" if cell.policy.startswith("regions") else "selective"
    return offload_targets.with_offload(p.model, p.blocks, mode, policy, moved)


def _context(policy: Any, plain: bool) -> dict[str, Any]:
    """sac2's checkpoint keyword arguments for ``policy`` (none for full AC): a partial, or a plain function when
    ``plain`` (``matrix.Cell.plain_context_fn``)."""
    if policy is None:
        return {}
    if plain:
        return {"context_fn": lambda: sac2.create_selective_checkpoint_contexts(policy)}
    return {"context_fn": functools.partial(sac2.create_selective_checkpoint_contexts, policy)}


def _torch_context(policy: Any, plain: bool) -> dict[str, Any]:
    """As ``_context``, through torch's ``create_selective_checkpoint_contexts`` looked up as an attribute."""
    if policy is None:
        return {}
    if plain:
        return {"context_fn": lambda: tuc.create_selective_checkpoint_contexts(policy)}
    return {"context_fn": functools.partial(tuc.create_selective_checkpoint_contexts, policy)}


def _torch_call(kwargs: dict[str, Any], layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """torch's checkpoint looked up as an attribute at call time (the install_attr route)."""
    return tuc.checkpoint(layer, x, use_reentrant=False, **kwargs)


# ---- routes ----


def apply_route(cell: Cell, p: Problem) -> sac2.integrations.Installation | None:
    """Checkpoint ``p``'s blocks by the cell's route with its policy; the installation to undo, if any."""
    route, kind, plain, model = cell.route, cell.policy, cell.plain_context_fn, p.model
    if route == "torchtitan":
        from torchtitan.distributed import activation_checkpoint as tt_ac

        from sac2.integrations.torchtitan import apply_ac

        config = tt_ac.FullAC.Config() if kind == "full" else tt_ac.SelectiveAC.Config()
        apply_ac(config, model)
        return None
    if route == "apply_ac":
        offload = _offload_targets(cell)
        if kind == "full":
            sac2.apply_ac(model, "full", offload=offload, **_respect(cell))
        elif kind in ("regions", "regions_keep_inputs"):
            sac2.apply_ac(model, "regions", save=["attention", "linear"], keep_inputs=kind == "regions_keep_inputs",
                          offload=offload, **_respect(cell))
        elif kind == "budget_apply_ac":
            with warnings.catch_warnings():  # a plan that keeps nothing says so: full AC is a cell like any other
                warnings.filterwarnings("ignore", message=".*nothing a budget could keep pays")
                sac2.apply_ac(model, memory_budget=0.5, example_inputs=p.inputs, **_respect(cell))
        else:
            sac2.apply_ac(model, "selective", policy=make_policy(kind, p), offload=offload, **_respect(cell))
        return None
    policy = with_offload(cell, p, make_policy(kind, p))
    installation = None
    # transformers calls torch's checkpoint: offload's schedule runs on sac2's frame, which install() puts under it
    hf_frame = route == "hf" and (policy is None or cell.offload != "none")
    if route in ("install_import", "install_attr", "torch_wrapper") or hf_frame:
        installation = sac2.install()
    # Each context_fn is made once, here, as users make it: dynamo takes a partial made inside compiled code, but
    # not a function defined there ("checkpoint not implemented for NestedUserFunctionVariable").
    if route == "checkpoint":
        kwargs = {**_context(policy, plain), **_respect(cell)}
        model.call = lambda layer, x: sac2.checkpoint(layer, x, **kwargs)
    elif route == "install_import":
        model.call = functools.partial(torch_style.call, {**torch_style.context(policy, plain), **_respect(cell)})
    elif route == "install_attr":
        model.call = functools.partial(_torch_call, {**_torch_context(policy, plain), **_respect(cell)})
    elif route == "wrapper":
        for i, layer in enumerate(model.layers):
            model.layers[i] = sac2.checkpoint_wrapper(layer, **_context(policy, plain), **_respect(cell))
    elif route == "apply_activation_checkpointing":
        wrapper = functools.partial(sac2.checkpoint_wrapper, **_context(policy, plain), **_respect(cell))
        sac2.apply_activation_checkpointing(model, wrapper, check_fn=lambda m: isinstance(m, Block))
    elif route == "torch_wrapper":
        kwargs = {**torch_style.context(policy, plain), **_respect(cell)}
        model.layers[0] = torch_style.wrap(kwargs, model.layers[0], with_class=False)
        model.layers[1] = torch_style.wrap(kwargs, model.layers[1], with_class=True)
    elif route == "hf":  # docs/huggingface.md: route 1 (a sac2 context_fn), full AC by route 3 (install)
        kwargs = {"use_reentrant": False, **_context(policy, plain), **_respect(cell)}
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    else:
        raise AssertionError(route)
    return installation


# ---- executions ----

_COMPILE: dict[str, dict[str, Any]] = {
    "aot_eager": dict(backend="aot_eager"),
    "inductor": {},
    "fullgraph": dict(backend="aot_eager", fullgraph=True),
    "dynamic": dict(backend="aot_eager", dynamic=True),
}


def compile_inside(execution: str, p: Problem) -> None:
    """Compile code inside ``p``'s blocks by an ``INSIDE`` execution (``<what>_<backend>``): every direct submodule
    of each block (``module.compile``; dynamo runs torch's own modules, such as ``nn.Linear``, as they are), or
    the forward of each block's norms as a function (``torch.compile(norm.forward)``, set on the instance)."""
    what, backend = execution.split("_", 1)
    for _, block in p.blocks:
        if what == "submodules":
            for child in block.children():
                child.compile(backend=backend)
        else:
            for name in p.norms:
                norm = block.get_submodule(name)
                norm.forward = torch.compile(norm.forward, backend=backend)


# ---- what is around the step (the user's tools) ----


class _PassThrough(TorchDispatchMode):
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return func(*args, **(kwargs or {}))


def _tool(around: str) -> contextlib.AbstractContextManager[object]:
    """A fresh instance of the tool ``around`` names (``matrix.AROUND``)."""
    if around.startswith("flops"):
        return FlopCounterMode(display=False)
    if around.startswith("memtracker"):
        from torch.distributed._tools.mem_tracker import MemTracker

        return MemTracker()
    if around.startswith("passthrough"):
        return _PassThrough()
    if around.startswith("save_on_cpu"):
        return torch.autograd.graph.save_on_cpu()
    if around.startswith("user_hooks"):
        return torch.autograd.graph.saved_tensors_hooks(torch.clone, _unpacked)
    raise AssertionError(around)


def _unpacked(t: torch.Tensor) -> torch.Tensor:
    return t


def _respect(cell: Cell) -> dict[str, Any]:
    """The checkpoint keyword the cell's route passes for what is around it: respect_saved_tensors_hooks=True for
    the ``*_respect`` values of ``matrix.AROUND``."""
    return {"respect_saved_tensors_hooks": True} if cell.around.endswith("_respect") else {}


def _phases(around: str) -> tuple[contextlib.AbstractContextManager[object], ...]:
    """(the whole step, its forward, its backward): where ``around``'s tool is active."""
    if around == "none":
        return contextlib.nullcontext(), contextlib.nullcontext(), contextlib.nullcontext()
    tool = _tool(around)
    if around.endswith("_forward"):
        return contextlib.nullcontext(), tool, contextlib.nullcontext()
    if around.endswith("_backward"):
        return contextlib.nullcontext(), contextlib.nullcontext(), tool
    return tool, contextlib.nullcontext(), contextlib.nullcontext()


# ---- backward styles ----


def run_backward(style: str, step: Callable[[], torch.Tensor], names: list[str],
                 leaves: list[torch.Tensor], around: str = "none") -> dict[str, torch.Tensor | None]:
    """One step in ``style`` with ``around``'s tool where it says: the loss and each leaf's ``.grad`` (and, for
    double backward, the first-order gradients the second backward went through)."""
    whole, forward, backward = _phases(around)
    with whole:
        for leaf in leaves:
            leaf.grad = None
        with forward:
            loss = step()
        with backward:
            return _backward(style, loss, names, leaves)


def _backward(style: str, loss: torch.Tensor, names: list[str],
              leaves: list[torch.Tensor]) -> dict[str, torch.Tensor | None]:
    result: dict[str, torch.Tensor | None] = {"loss": loss.detach()}
    if style == "once":
        loss.backward()
    elif style == "retain_twice":
        loss.backward(retain_graph=True)
        loss.backward()
    elif style == "double":
        first = torch.autograd.grad(loss, leaves, create_graph=True, allow_unused=True)
        result.update({f"d/{n}": None if g is None else g.detach() for n, g in zip(names, first, strict=True)})
        squares = [g.pow(2).sum() for g in first if g is not None]
        sum(squares[1:], squares[0]).backward()  # a tensor's sum: no int 0 to start from
    elif style == "inputs":
        loss.backward(inputs=leaves[::2])
    else:
        raise AssertionError(style)
    result.update({f"grad/{n}": leaf.grad for n, leaf in zip(names, leaves, strict=True)})
    return result


@functools.lru_cache(maxsize=None)
def reference(kind_route: str, style: str, around: str = "none") -> dict[str, torch.Tensor | None]:
    """What ``style`` gives without any checkpointing, in eager, with ``around``'s tool, on the problem of
    ``kind_route``."""
    p = problem(kind_route)
    return run_backward(style, lambda: p.loss(p.model, *p.inputs), p.names, p.leaves, around)


# ---- setups, reused by consecutive cells ----


@dataclass
class Setup:
    key: tuple[str, ...]
    problem: Problem | None = None
    step: Callable[[], torch.Tensor] | None = None
    installation: Any = None
    error: BaseException | None = None
    warm_count: int = 0  # forward_count's move over the warm-up step (compiled setups)
    fallbacks: int = 0  # the EagerFallbackWarnings of the warm-up step


_current: Setup | None = None


def close() -> None:
    """Undo the current setup (its installation) and forget it."""
    global _current
    if _current is not None and _current.installation is not None:
        _current.installation.uninstall()
    _current = None


def _kept(cell: Cell) -> bool:
    """Whether a cell with compiled code has a backward that keeps its graph (retain_graph, create_graph)."""
    return cell.compiles and cell.backward in ("retain_twice", "double")


def _key(cell: Cell) -> tuple[str, ...]:
    """What a setup is shared by. A compiled backward that keeps its graph runs without donated buffers
    (``matrix``'s no_donated_buffers rule), which is decided when it compiles: those cells share their own setup."""
    # A tool around the step gets its own setup: the module trackers of FlopCounterMode and MemTracker leave
    # gradient hooks on tensors of the model they watched a recompute of (torch's), which later cells would meet.
    return (cell.route, cell.execution, cell.policy, "kept" if _kept(cell) else "plain", cell.around, cell.offload)


def _build(cell: Cell) -> Setup:
    setup = Setup(_key(cell))
    torch._dynamo.reset()
    counters.clear()
    p = setup.problem = problem(cell.route)
    try:
        if cell.offload == "inputs" and isinstance(p.model, Net):
            p.model.activation_input = True  # else block 0's input is the caller's leaf, block 1 the last: none moves
        if cell.inside:  # as a user compiles parts of the model, then checkpoints its blocks
            compile_inside(cell.execution, p)
        with stand_in() if offloads(cell) else contextlib.nullcontext():  # apply_ac offloads where a device is
            setup.installation = apply_route(cell, p)
        loss = p.loss
        if cell.compiled:
            loss = torch.compile(loss, **_COMPILE[cell.execution])
        setup.step = lambda: loss(p.model, *p.inputs)
        if cell.compiles:  # warm up: compile forward and backward, in a backward style that succeeds
            before = sac2.forward_count()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always", sac2.EagerFallbackWarning)
                run_backward("retain_twice" if _kept(cell) else "once", setup.step, p.names, p.leaves)
            setup.warm_count = sac2.forward_count() - before
            setup.fallbacks = sum(issubclass(w.category, sac2.EagerFallbackWarning) for w in caught)
    except Exception as error:  # every cell of this setup reports it
        setup.error = error
    return setup


def setup_for(cell: Cell) -> Setup:
    global _current
    if _current is None or _current.key != _key(cell):
        close()
        _current = _build(cell)
    if _current.error is not None:
        raise _current.error
    return _current


def compare(got: dict, want: dict, exact: bool) -> None:
    """Every entry equal: bitwise when ``exact``, else within float32 tolerances (compiled code reorders sums)."""
    assert got.keys() == want.keys()
    for name, value in want.items():
        if value is None:
            assert got[name] is None, f"{name}: expected no gradient, got one"
            continue
        assert got[name] is not None, f"{name}: no gradient"
        if exact:
            diff = (got[name] - value).abs().max().item()
            assert torch.equal(got[name], value), f"{name} differs from no checkpointing (max abs diff {diff:.3g})"
        else:
            torch.testing.assert_close(got[name], value, rtol=1e-4, atol=1e-5, msg=functools.partial(_named, name))


def _named(name: str, message: str) -> str:
    return f"{name}: {message}"


def run_cell(cell: Cell) -> None:
    """Run ``cell`` and check it: the loss and every gradient as without checkpointing, or the error its rule
    names; sac2 ran (``forward_count`` moved, in a compiled setup while it compiled); compiled, no graph break
    and no compile again on a later step; no dispatch mode left behind."""
    functorch: dict[str, Any] = {"donated_buffer": False} if cell.without_donated_buffers else {}
    inductor: dict[str, Any] = {"fx_graph_cache": False} if cell.without_fx_graph_cache else {}
    with torch._functorch.config.patch(**functorch), torch._inductor.config.patch(**inductor):
        _run_cell(cell)


def _run_cell(cell: Cell) -> None:
    setup = setup_for(cell)
    p = setup.problem
    assert p is not None and setup.step is not None
    before, graphs = sac2.forward_count(), counters["stats"]["unique_graphs"]
    expected = cell.expected_error
    if expected is not None:
        with pytest.raises(RuntimeError, match=expected.match):
            run_backward(cell.backward, setup.step, p.names, p.leaves, cell.around)
    else:
        with stand_in() if offloads(cell) else contextlib.nullcontext() as link:
            got = run_backward(cell.backward, setup.step, p.names, p.leaves, cell.around)
        if cell.offload != "none" and not cell.around.startswith(("save_on_cpu", "user_hooks")):
            assert link is not None and any(kind == "to_host" for kind, _ in link.log), "nothing was offloaded"
        want = reference(cell.route if cell.route in LIBRARY else "small", cell.backward, cell.around)
        compare(got, want, exact=not cell.compiles)
    assert not torch._C._len_torch_dispatch_stack(), "a dispatch mode was left on the stack"
    if cell.counts:
        moved = setup.warm_count if cell.compiled else sac2.forward_count() - before
        assert moved > 0, "sac2.forward_count() did not move: sac2 did not run this checkpoint"
    if cell.inside:  # the code inside the blocks ran compiled, not eagerly (which a skipped frame would, silently)
        assert counters["stats"]["unique_graphs"] > 0, "nothing inside the blocks compiled"
    if cell.compiles:
        breaks = dict(counters["graph_break"])
        if cell.falls_back:
            assert breaks and setup.fallbacks, f"expected a fallback that sac2 warns about: {breaks}"
        else:
            assert not breaks, f"graph breaks: {breaks}"
        assert counters["stats"]["unique_graphs"] == graphs, "a later step compiled again"
