"""The seam matrix: its dimensions, the one table of rules that says which cells are meaningful and what each
must do, and the cells the suite runs (a pairwise covering design by default, the full product on request).

A cell is one (route, execution, policy, backward, around, offload) combination; its id is
``route-execution-policy-backward-around-offload``. An execution compiles the whole step (``COMPILED``: the
checkpoint is torch's operator in a graph) or only code inside the blocks (``INSIDE``: the checkpoint runs eagerly,
on sac2's frame, around compiled submodules or a compiled function).
Every rule is here, with its reason in words: which combinations are excluded, which end in an error torch
documents, where ``sac2.forward_count()`` cannot move because sac2 is not in the path, and which cells are known
sac2 bugs (``pytest.mark.xfail(strict=True)`` until fixed). ``tests/seams/harness.py`` only runs a cell.

``SAC2_SEAMS=full`` selects every valid cell; by default a pairwise covering design: every pair of values of any
two dimensions that some valid cell has appears in at least one selected cell (``test_seams.py`` checks it).
``SAC2_SEAMS=ci`` is the full product for eager and aot_eager with nothing around the step and nothing offloaded,
plus the pairwise set (which covers the other executions, the user's tools around the step and offload);
``SAC2_SEAMS=ci-rest`` is that selection less the pairwise cells the default suite already ran (those of routes that
need no client library), so CI runs no cell twice.
"""

from __future__ import annotations

import heapq
import importlib.util
import inspect
import itertools
import os
from dataclasses import dataclass
from typing import Callable

import torch.utils.checkpoint as tuc

__all__ = [
    "ROUTES", "EXECUTIONS", "POLICIES", "BACKWARDS", "AROUND", "OFFLOAD", "DIMENSIONS", "COMPILED", "INSIDE", "Cell",
    "Rule",
    "RULES",
    "BUGS",
    "LIBRARY", "CI_FULL", "product", "valid_cells", "pairs_of", "pairwise", "trimmed", "selected", "bug_of",
]

#: Whether this torch's checkpoint takes respect_saved_tensors_hooks (2.14+).
_TORCH_TAKES_HOOKS_FLAG = "respect_saved_tensors_hooks" in inspect.signature(tuc.checkpoint).parameters
#: Whether transformers' attention runs under the kernels package's wrapper (transformers 5.25+ requires kernels).
_HF_KERNELS = importlib.util.find_spec("kernels") is not None

# ---- the dimensions ----

ROUTES = (
    "checkpoint",  # sac2.checkpoint(block, x, context_fn=...)
    "install_import",  # torch's names bound at import by a client module, called under sac2.install()
    "install_attr",  # torch.utils.checkpoint.checkpoint(...) looked up as an attribute, under sac2.install()
    "wrapper",  # sac2.checkpoint_wrapper
    "apply_activation_checkpointing",  # sac2.apply_activation_checkpointing
    "torch_wrapper",  # torch's checkpoint_wrapper (block 0) and CheckpointWrapper (block 1), under sac2.install()
    "apply_ac",  # sac2.apply_ac(model, mode=...)
    "hf",  # transformers: model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=...); install() for
    # full AC and for offload (whose schedule runs on sac2's frame)
    "torchtitan",  # sac2.integrations.torchtitan.apply_ac(FullAC / SelectiveAC config, model)
)
EXECUTIONS = (
    "eager", "aot_eager", "inductor", "fullgraph", "dynamic",
    # compiled code inside an eager checkpoint: each block's submodules compiled (module.compile) or the forward of
    # its norms compiled as a function (torch.compile(module.forward)), with each backend
    "submodules_eager", "submodules_aot_eager", "submodules_inductor",
    "function_eager", "function_aot_eager", "function_inductor",
)
POLICIES = (
    "full",  # no context_fn: full activation checkpointing
    "op_list",  # [aten.mm, aten.addmm, aten.bmm]
    "policy_fn",  # a plain policy function
    "llm",  # sac2.policies.llm()
    "every_other_matmul",  # sac2.policies.every_other_matmul()
    "torchtitan",  # sac2.policies.torchtitan(model); torchtitan's own SelectiveAC on the torchtitan route
    "compose",  # compose(recompute_linears(model, [...]), llm())
    "budget",  # sac2.policies.memory_budget(block, inputs, 0.5, cost="flops"), profiled in eager
    "budget_apply_ac",  # sac2.apply_ac(model, memory_budget=0.5, example_inputs=...): a plan per kind of block
    "regions",  # a save list of only sac2.Regions (the model's calls made regions); their inputs rebuilt
    "regions_keep_inputs",  # the same, keep_inputs=True: what the regions' bodies save of their inputs kept for real
    "offload",  # MUST_CPU_OFFLOAD for matmuls
)
BACKWARDS = (
    "once",  # loss.backward()
    "retain_twice",  # loss.backward(retain_graph=True) twice
    "double",  # torch.autograd.grad(create_graph=True), then backward through the gradients
    "inputs",  # loss.backward(inputs=[every other leaf])
)
AROUND = (
    "none",  # nothing: the step as it is
    "flops_forward",  # torch's FlopCounterMode active over the forward only
    "flops_backward",  # ... over the backward only (the recompute runs under it)
    "memtracker_both",  # torch.distributed._tools' MemTracker over forward and backward
    "passthrough_forward",  # a user's do-nothing TorchDispatchMode over the forward only
    "save_on_cpu",  # torch.autograd.graph.save_on_cpu() around the step (an outer pair of saved-tensor hooks)
    "save_on_cpu_respect",  # the same, the route passing respect_saved_tensors_hooks=True
    "user_hooks",  # a user's saved_tensors_hooks pair (pack copies) around the step, the route passing no flag
    "user_hooks_respect",  # the same pair, the route passing respect_saved_tensors_hooks=True
)
OFFLOAD = (  # what apply_ac(offload=...) moves to host memory on top of the policy, through the CPU stand-in
    "none",  # nothing
    "regions",  # the attention calls made regions and kept in host memory (offload=["attention"])
    "inputs",  # each block's checkpoint inputs kept in host memory (offload=["inputs"])
)
DIMENSIONS = {"route": ROUTES, "execution": EXECUTIONS, "policy": POLICIES, "backward": BACKWARDS, "around": AROUND,
              "offload": OFFLOAD}
#: The step is compiled: the checkpoint is torch's operator, traced into the graph.
COMPILED = frozenset({"aot_eager", "inductor", "fullgraph", "dynamic"})
#: Code inside the blocks is compiled; the checkpoint runs eagerly around it.
INSIDE = frozenset(EXECUTIONS) - COMPILED - {"eager"}

#: The library a route needs; its cells skip (pytest.importorskip, naming it) where it is not installed.
LIBRARY = {"hf": "transformers", "torchtitan": "torchtitan"}

#: Rough relative cost of a value, used only to break ties when the pairwise design picks between cells that
#: cover as many new pairs: the cheaper cell wins, so the default suite compiles no more than coverage needs.
_COST = {
    "aot_eager": 1, "fullgraph": 1, "dynamic": 3, "inductor": 4, "submodules_eager": 1, "function_eager": 1,
    "submodules_aot_eager": 1, "function_aot_eager": 1, "submodules_inductor": 4, "function_inductor": 4, "hf": 2,
    "torchtitan": 3,
}


@dataclass(frozen=True, order=True)
class Cell:
    route: str
    execution: str
    policy: str
    backward: str
    around: str = "none"
    offload: str = "none"

    @property
    def id(self) -> str:
        return f"{self.route}-{self.execution}-{self.policy}-{self.backward}-{self.around}-{self.offload}"

    @property
    def compiled(self) -> bool:
        return self.execution in COMPILED

    @property
    def inside(self) -> bool:
        """Compiled code inside an eager checkpoint."""
        return self.execution in INSIDE

    @property
    def aot(self) -> bool:
        """Something in the step is compiled through AOTAutograd (every backend but dynamo's eager one)."""
        return self.compiled or (self.inside and self.execution.split("_", 1)[1] != "eager")

    @property
    def compiles(self) -> bool:
        """Something in the step compiles: its graphs are counted, its gradients compared within tolerances."""
        return self.compiled or self.inside

    def value(self, dimension: str) -> str:
        return getattr(self, dimension)

    @property
    def expected_error(self) -> Rule | None:
        """The ``error`` rule this cell must end in (its ``match`` is a regex on the message), or None."""
        return next((r for r in RULES if r.kind == "error" and r.when(self)), None)

    @property
    def falls_back(self) -> bool:
        """Whether this compiled cell's checkpoints break dynamo's graph and run eagerly, sac2 warning the user
        (a ``falls_back`` rule)."""
        return any(r.kind == "falls_back" and r.when(self) for r in RULES)

    @property
    def counts(self) -> bool:
        """Whether sac2's ``forward_count()`` must move: sac2 is in this cell's path."""
        return not any(r.kind == "not_sac2" and r.when(self) for r in RULES)

    @property
    def without_donated_buffers(self) -> bool:
        """Whether the cell runs with ``torch._functorch.config.donated_buffer=False``."""
        return any(r.kind == "no_donated_buffers" and r.when(self) for r in RULES)

    @property
    def without_fx_graph_cache(self) -> bool:
        """Whether the cell compiles with inductor's FX graph cache off."""
        return any(r.kind == "no_fx_graph_cache" and r.when(self) for r in RULES)

    @property
    def plain_context_fn(self) -> bool:
        """Whether the harness passes the policy in a plain function rather than a ``functools.partial``."""
        return any(r.kind == "plain_context_fn" and r.when(self) for r in RULES)


@dataclass(frozen=True)
class Rule:
    """``kind``: ``exclude`` (the cell is not meaningful and is not generated), ``error`` (the cell must raise an
    error matching ``match``), ``not_sac2`` (sac2 is not in the path: forward_count is not checked),
    ``plain_context_fn`` (the documented way to pass this policy is a plain function, not a partial),
    ``no_donated_buffers`` (the cell compiles and runs with ``torch._functorch.config.donated_buffer=False``),
    ``no_fx_graph_cache`` (the cell compiles with inductor's FX graph cache off), ``falls_back`` (a compiled cell
    whose checkpoints break the graph and run eagerly: the cell checks that sac2 warned, ``EagerFallbackWarning``,
    and the gradients)."""

    kind: str
    text: str
    when: Callable[[Cell], bool]
    match: str = ""


_SMALL_MODEL_ROUTES = frozenset(ROUTES) - {"hf", "torchtitan"}

RULES: tuple[Rule, ...] = (
    Rule(
        "exclude",
        "torchtitan's apply_ac takes torchtitan's AC config, which has no context_fn: the route only runs full AC "
        "(FullAC) and torchtitan's own selective policy (SelectiveAC, the 'torchtitan' policy).",
        lambda c: c.route == "torchtitan" and c.policy not in ("full", "torchtitan"),
    ),
    Rule(
        "exclude",
        "Only sac2.apply_ac takes memory_budget=: on the other routes the user builds the context_fn from a budget "
        "policy (the 'budget' policy).",
        lambda c: c.policy == "budget_apply_ac" and c.route != "apply_ac",
    ),
    Rule(
        "exclude",
        "What apply_ac(memory_budget=) chooses per block (full AC, saved regions, an op-level budget) is timed on the "
        "machine, so whether a compiled cell runs sac2's modes or torch's own full AC is not known before it runs; "
        "tests/test_apply_budget.py compiles a budget with fullgraph=True and checks that its bytes hold.",
        lambda c: c.policy == "budget_apply_ac" and c.compiled,
    ),
    Rule(
        "exclude",
        "apply_ac takes a memory_budget or an offload list, not both (a budget prices keeping on the device; it "
        "raises ValueError for the pair).",
        lambda c: c.policy == "budget_apply_ac" and c.offload != "none",
    ),
    Rule(
        "exclude",
        "The tiny Llama and torchtitan's debug model attend with SDPA, whose CPU kernel "
        "(_scaled_dot_product_flash_attention_for_cpu) has no double backward: the un-checkpointed reference raises "
        "too, so there is nothing to compare with.",
        lambda c: c.route in LIBRARY and c.backward == "double",
    ),
    Rule(
        "exclude",
        "A user's dispatch mode or saved-tensor hooks around compiled code (the step, or submodules inside the "
        "checkpoint): dynamo skips frames under a dispatch mode that does not ignore compile internals (torch's "
        "'non-infra torch dispatch mode present'), and saved-tensor hooks around a compiled region are torch's "
        "business, so these cells would test eager again or torch alone. The tools are crossed with every route, "
        "policy and backward in eager.",
        lambda c: c.compiles and c.around != "none",
    ),
    Rule(
        "exclude",
        "Offload's schedule runs on sac2's eager frame: under torch.compile the checkpoint is torch's operator and "
        "its partitioner decides what is kept, so a compiled cell would not offload; torchtitan's AC config has no "
        "offload option for the route to pass.",
        lambda c: c.offload != "none" and (c.compiled or c.route == "torchtitan"),
    ),
    Rule(
        "exclude",
        "A module made a region and compiled on its own (module.compile() on the attention module itself) is traced "
        "by dynamo, region annotation and all, as its own graph: inside an eager checkpoint it is compiled code the "
        "checkpoint recomputes, not a region it sees, so there is nothing to offload (docs/compiled.md).",
        lambda c: c.offload == "regions" and c.execution.startswith("submodules_"),
    ),
    Rule(
        "exclude",
        "torchtitan's activation-checkpoint config has no option for the checkpoint's saved-tensor hooks flag, so "
        "the route cannot pass respect_saved_tensors_hooks (its cells without the flag run under the same hooks).",
        lambda c: c.route == "torchtitan" and c.around.endswith("_respect"),
    ),
    *(  # a rule of this torch only (2.13), so that no rule is dead on the others
        []
        if _TORCH_TAKES_HOOKS_FLAG
        else [
            Rule(
                "exclude",
                "torch 2.13's checkpoint has no respect_saved_tensors_hooks parameter (it passes unknown keywords to "
                "the checkpointed function), so routes through torch's own names cannot pass it there.",
                lambda c: c.around.endswith("_respect")
                and c.route in ("install_import", "install_attr", "torch_wrapper", "hf"),
            )
        ]
    ),
    *(  # rules of transformers with the kernels package (5.25+) only, so that no rule is dead without it
        [
            Rule(
                "falls_back",
                "transformers 5.25's attention (the kernels package's wrapper) sets and resets a context variable, "
                "which dynamo refuses inside torch's checkpoint operator ('HOP: Unsafe side effect'). The hf route "
                "with a context_fn is HF's gradient_checkpointing_kwargs without install(): torch's checkpoint, "
                "called by HF, which sac2 does not reach while dynamo traces, so each layer breaks the graph and "
                "runs eagerly, as on stock torch; sac2 warns (EagerFallbackWarning). install() (the full-AC cells) "
                "and sac2's own routes keep the change in the graph (docs/huggingface.md).",
                lambda c: c.route == "hf" and c.compiled and c.policy != "full" and c.execution != "fullgraph",
            ),
            Rule(
                "exclude",
                "The same under fullgraph=True: dynamo raises its graph break ('HOP: Unsafe side effect') while it "
                "compiles, before any step runs, as it does on stock torch; the fallback cells show the route.",
                lambda c: c.route == "hf" and c.execution == "fullgraph" and c.policy != "full",
            ),
        ]
        if _HF_KERNELS
        else []
    ),
    Rule(
        "error",
        "Double backward under torch.compile is unsupported by torch.compile itself: AOTAutograd's compiled backward "
        "(of the step, or of a compiled submodule inside the checkpoint) is not differentiable, and the second "
        "backward raises whether or not anything is checkpointed (dynamo's eager backend has no AOTAutograd: it "
        "differentiates twice).",
        lambda c: c.aot and c.backward == "double",
        match="torch.compile with aot_autograd does not currently support double backward",
    ),
    Rule(
        "error",
        "torch bug, with torch's own frame too: the module tracker of FlopCounterMode and MemTracker, active over a "
        "torch.autograd.grad "
        "that recomputes a checkpoint, hooks the modules the recompute runs and asks the engine about their leaf "
        "inputs, which raises during autograd.grad (backward() is fine, and without checkpointing nothing runs "
        "forward inside the backward). Not FlopCounterMode over the backward where offload moves the inputs: the "
        "small model's input passes through x * 1.0 there (bitwise the same), so that its first block's input is an "
        "activation offload can move, and no module the recompute runs has a leaf input (MemTracker, over the "
        "forward too, also tracks the model's own input, a leaf).",
        lambda c: c.backward == "double"
        and (c.around == "memtracker_both" or (c.around == "flops_backward" and c.offload != "inputs")),
        match="A leaf node was passed to _will_engine_execute_node",
    ),
    Rule(
        "no_donated_buffers",
        "A compiled backward that donates buffers refuses retain_graph=True and create_graph=True, whatever is "
        "checkpointed; torch's error says to set torch._functorch.config.donated_buffer=False, as a user must: these "
        "cells compile and run with it off (whether a backward donates depends on what the policy saves).",
        lambda c: c.aot and c.backward in ("retain_twice", "double"),
    ),
    Rule(
        "no_fx_graph_cache",
        "torch bug, reproduced without checkpointing: inductor's FX graph cache key ignores donated_buffer, so a "
        "backward compiled and cached with donated buffers (by a once/inputs cell) is served to a compile with "
        "donated_buffer=False, and backward(retain_graph=True) twice then gives wrong gradients, silently. These "
        "cells compile with the FX graph cache off (torch._inductor.config.fx_graph_cache=False).",
        lambda c: c.execution.endswith("inductor") and c.backward in ("retain_twice", "double"),
    ),
    Rule(
        "not_sac2",
        "Full AC under torch.compile is torch's own checkpoint operator on every route: dynamo turns the call "
        "into its tag_activation_checkpoint HOP, and with no context_fn there are no modes; sac2.checkpoint hands "
        "it over uncounted (a counter dynamo traced would be guarded on and recompile every step).",
        lambda c: c.compiled and c.policy == "full",
    ),
    Rule(
        "plain_context_fn",
        "Under torch.compile a save list of sac2.Regions goes to checkpoint in a plain function "
        "(lambda: create_selective_checkpoint_contexts(regions)), not a functools.partial: docs/compiled.md says "
        "dynamo cannot read a list policy a partial holds (for Regions it cannot: 'Not a Python constant'). Where "
        "the user builds the context_fn; sac2.apply_ac builds its own.",
        lambda c: c.compiled and c.policy.startswith("regions") and c.route not in ("apply_ac", "torchtitan"),
    ),
)

#: Known sac2 bugs: (predicate, reason). Their cells are marked xfail(strict=True) until fixed.
BUGS: tuple[tuple[Callable[[Cell], bool], str], ...] = (
)


def bug_of(cell: Cell) -> str | None:
    return next((reason for when, reason in BUGS if when(cell)), None)


# ---- the cells ----


def product() -> list[Cell]:
    return [Cell(*values) for values in itertools.product(*DIMENSIONS.values())]


def valid_cells() -> list[Cell]:
    excluded = [r for r in RULES if r.kind == "exclude"]
    return [c for c in product() if not any(r.when(c) for r in excluded)]


def pairs_of(cell: Cell) -> set[tuple[str, str, str, str]]:
    """The (dimension, value, dimension, value) pairs a cell covers."""
    names = list(DIMENSIONS)
    return {(a, cell.value(a), b, cell.value(b)) for a, b in itertools.combinations(names, 2)}


def _cost(cell: Cell) -> int:
    return sum(_COST.get(cell.value(d), 0) for d in DIMENSIONS)


def pairwise(cells: list[Cell], covered: frozenset = frozenset()) -> list[Cell]:
    """A pairwise covering design over ``cells``: greedily (deterministic) take the cell covering the most pairs not
    yet covered, the cheaper one on a tie, then the first in ``cells``' order, until every pair some cell has is
    (``covered``: pairs other cells cover already).

    Lazily: a cell's count of new pairs only falls as others are taken, so the heap holds each cell under the count
    it had when last looked at, and the cell on top is taken once its fresh count still puts it first."""
    pairs = [pairs_of(c) for c in cells]
    uncovered = set().union(*pairs) - covered
    heap = [(-len(p & uncovered), _cost(c), i) for i, (c, p) in enumerate(zip(cells, pairs, strict=True))]
    heapq.heapify(heap)
    chosen: list[Cell] = []
    while uncovered:
        _, cost, i = heapq.heappop(heap)
        fresh = (-len(pairs[i] & uncovered), cost, i)
        if heap and fresh > heap[0]:
            heapq.heappush(heap, fresh)  # others may now cover more: look again
            continue
        uncovered -= pairs[i]
        chosen.append(cells[i])
    return sorted(chosen)


#: ``SAC2_SEAMS=ci``: every cell of these executions, and the pairwise design for the others.
CI_FULL = ("eager", "aot_eager")


def trimmed(cells: list[Cell]) -> list[Cell]:
    """The ``ci`` selection: the full product of ``CI_FULL``'s executions (sac2's own compiled path, the modes
    tagging nodes for the partitioner, on every route, policy and backward, nothing offloaded) and the default
    pairwise set, which covers the pairs only the other executions, the user's tools and offload have (inductor's
    code generation, fullgraph, symbolic shapes)."""
    base = {c for c in cells if c.execution in CI_FULL and c.around == "none" and c.offload == "none"}
    return sorted(base | set(pairwise(cells)))


def selected() -> list[Cell]:
    """The cells this run checks (``SAC2_SEAMS``): ``full``, every valid cell; ``ci``, ``trimmed``; by default
    the pairwise set. Sorted, so that the cells sharing a (route, execution, policy) run one after another
    (``harness`` reuses its setup)."""
    cells = valid_cells()
    mode = os.environ.get("SAC2_SEAMS", "pairwise")
    if mode == "full":
        return sorted(cells)
    if mode == "ci":
        return trimmed(cells)
    if mode == "ci-rest":
        ran = {c for c in pairwise(cells) if c.route in _SMALL_MODEL_ROUTES}  # the default suite's, clients aside
        return [c for c in trimmed(cells) if c not in ran]
    if mode == "pairwise":
        return pairwise(cells)
    raise ValueError(f"SAC2_SEAMS={mode!r}: expected 'pairwise' (the default), 'ci', 'ci-rest' or 'full'.")
