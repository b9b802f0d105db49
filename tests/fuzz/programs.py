"""Random straight-line programs for the differential fuzzer, written as Python source.

A program is the source of one function ``program(x0, x1, ...)``: a list of statements, each a few lines built
by one op *kind* of ``KINDS`` (a table of small functions), plus a policy, a backward style and the checkpoint
options. Being source, a program prints as its own reproducer and runs with ``exec`` in ``namespace(ckpt)``,
which provides torch, sac2 and the fuzzer's custom ops, autograd.Function, user-defined HOP and regions.
Everything is drawn from ``random.Random(seed)``: the same seed gives the same program.
"""

from __future__ import annotations

import dataclasses
import random
import zlib
from typing import Any, Callable, Iterator

import torch
import torch.nn.functional as F
from torch._C import DispatchKey
from torch._ops import HigherOrderOperator

import sac2
from sac2 import CheckpointPolicy

__all__ = [
    "Program", "PolicySpec", "InputSpec", "Answers", "generate", "namespace", "op_key", "KINDS", "BACKWARDS",
    "ANSWERS", "HOOKS", "pack_restrided",
]  # fmt: skip

D = 4  # every dimension the generator picks is D or 2: small tensors, many ops per millisecond
#: How a case runs backward (``tests.fuzz.oracle`` runs them): ``grad`` autograd.grad of all outputs;
#: ``backward`` one backward; ``twice`` backward(retain_graph=True) then backward; ``split`` grad of some outputs,
#: then of the others; ``double`` grad(create_graph=True), then grad of a function of those gradients;
#: ``double_backward`` the same with .backward() second; ``grad_subset`` grad of a subset of the outputs;
#: ``inputs_subset`` backward(inputs=[...]) on a subset of the inputs; ``no_grad`` forward only, under no_grad.
BACKWARDS = (
    "grad", "backward", "twice", "split", "double", "double_backward", "grad_subset", "inputs_subset", "no_grad",
)  # fmt: skip
DOUBLE = ("double", "double_backward")  # the styles that differentiate twice

# ---- what programs can call besides torch: custom ops, an autograd.Function, a HOP, regions ----


@torch.library.custom_op("sac2_fuzz::scale", mutates_args=())
def _scale(x: torch.Tensor, s: float) -> torch.Tensor:
    return x * s


_scale.register_fake(lambda x, _s: torch.empty_like(x))
_scale.register_autograd(
    lambda ctx, grad: (grad * ctx.s, None),
    setup_context=lambda ctx, inputs, output: setattr(ctx, "s", inputs[1]),  # noqa: ARG005 (passed by keyword)
)


@torch.library.custom_op("sac2_fuzz::add_into_", mutates_args=("out",))
def _add_into_(out: torch.Tensor, x: torch.Tensor) -> None:
    out.add_(x)


class Cube(torch.autograd.Function):
    """x**3 with a hand-written (twice differentiable) backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * x * x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return grad * 3 * x * x


class ApplyTwice(HigherOrderOperator):
    """A user-defined HOP: ``fn(fn(x))``, as tests/test_hops.py builds one."""

    def __init__(self) -> None:
        super().__init__("sac2_fuzz_apply_twice")

    def __call__(self, fn: Callable, x: torch.Tensor) -> torch.Tensor:
        return super().__call__(fn, x)


apply_twice = ApplyTwice()


@apply_twice.py_impl(DispatchKey.CompositeExplicitAutograd)
def _apply_twice_dense(fn: Callable, x: torch.Tensor) -> torch.Tensor:
    return fn(fn(x))


class _ApplyTwiceAutograd(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, fn: Callable, x: torch.Tensor) -> torch.Tensor:
        ctx.fn = fn
        ctx.save_for_backward(x)
        with torch._C._AutoDispatchBelowAutograd():
            return apply_twice(fn, x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, torch.Tensor]:
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            x = x.detach().requires_grad_()
            return None, torch.autograd.grad(ctx.fn(ctx.fn(x)), x, grad)[0]


@apply_twice.py_autograd_impl
def _apply_twice_autograd(fn: Callable, x: torch.Tensor) -> torch.Tensor:
    return _ApplyTwiceAutograd.apply(fn, x)


def noisy(t: torch.Tensor) -> torch.Tensor:
    """Adds uniform noise: moves the generator, leaves the gradient alone."""
    return t + torch.rand_like(t)


def _fz_act(t: torch.Tensor) -> torch.Tensor:
    return torch.sigmoid(t) * t


def _fz_noise(t: torch.Tensor) -> torch.Tensor:
    return t * torch.rand_like(t)


def _fz_inplace(t: torch.Tensor) -> torch.Tensor:
    u = t * 2
    u.add_(1)
    return u.exp()


REGIONS = {"fz_act": _fz_act, "fz_noise": _fz_noise, "fz_inplace": _fz_inplace}
_REGION_FNS = {name: sac2.region(fn, name=name) for name, fn in REGIONS.items()}


#: How often the user pack hook may run in one case: a frame that records the hook's own ops and packs them again
#: never ends (sac2 did, at the end of its forward); past this the hook raises, so the case fails instead of hanging.
PACK_LIMIT = 400
_packs = [0]


def pack_restrided(t: torch.Tensor) -> torch.Tensor:
    """The user pack hook of the ``hooks`` kind: the same values in a copy with other strides (its dims reversed in
    memory), so a frame that hands the packed tensor back where the original is expected shows up."""
    _packs[0] += 1
    if _packs[0] > PACK_LIMIT:
        raise RuntimeError(f"fuzz: the user pack hook ran more than {PACK_LIMIT} times in one case (unbounded)")
    if t.is_nested or t.dim() < 2:
        return t.clone()
    return t.transpose(0, -1).contiguous().transpose(0, -1)


def replica(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` as it lies in memory: its whole storage copied, viewed with its offset and strides (``clone``
    makes a diagonal view contiguous). torch's CPU batch_norm backward reads a strided weight as if it were
    contiguous, so what it computes depends on the weight's neighbours in memory too."""
    if t.is_nested or t.layout is not torch.strided:
        return t.clone()
    storage = t.untyped_storage().clone()
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, t.storage_offset(), t.shape, t.stride())


def unpack_same(t: torch.Tensor) -> torch.Tensor:
    """The user unpack hook of the ``hooks`` kind."""
    return t


#: The outer saved-tensor hooks the ``hooks`` kind runs a case under, by name: the source that makes them.
HOOKS = {
    "save_on_cpu": "torch.autograd.graph.save_on_cpu()",
    "user": "torch.autograd.graph.saved_tensors_hooks(tests.fuzz.programs.pack_restrided, "
    "tests.fuzz.programs.unpack_same)",
}


def hooks_context(name: str) -> Any:
    """The context manager of ``HOOKS[name]`` (and a fresh count for ``PACK_LIMIT``)."""
    _packs[0] = 0
    if name == "save_on_cpu":
        return torch.autograd.graph.save_on_cpu()
    if name == "replica":  # the user hook's copy as the tensor lies in memory (the oracle's check of torch's kernels)
        return torch.autograd.graph.saved_tensors_hooks(replica, unpack_same)
    return torch.autograd.graph.saved_tensors_hooks(pack_restrided, unpack_same)


def namespace(ckpt: Callable[..., Any]) -> dict[str, Any]:
    """The globals a program runs with; ``ckpt(fn, *args)`` is the variant's nested checkpoint. ``stash`` is a
    fresh list per run: the ``after_write`` kind keeps forward intermediates there for the epilogue to write."""
    return {
        "stash": [],
        "torch": torch,
        "F": F,
        "sac2": sac2,
        "Cube": Cube,
        "apply_twice": apply_twice,
        "noisy": noisy,
        "ckpt": ckpt,
        **_REGION_FNS,
    }


# ---- policies ----

_CHOICES = (
    CheckpointPolicy.MUST_SAVE,
    CheckpointPolicy.PREFER_SAVE,
    CheckpointPolicy.MUST_RECOMPUTE,
    CheckpointPolicy.PREFER_RECOMPUTE,
    CheckpointPolicy.MUST_CPU_OFFLOAD,
    CheckpointPolicy.PREFER_CPU_OFFLOAD,
    True,
    False,
)


def op_key(op: Any) -> str:
    """A name for an op that ``PolicySpec`` can turn back into the op: ``aten.mm.default``, ``region fz_act``,
    ``apply_twice`` (the fuzzer's HOP)."""
    if type(op) is sac2.Region:
        return f"region {op.name}"
    if op is apply_twice:
        return "apply_twice"
    return str(op)


@dataclasses.dataclass
class HashPolicy:
    """A random but deterministic answer per (op, argument shapes): the same call gets the same answer in
    forward and in recompute, whichever library asks."""

    salt: int

    def __call__(self, _ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor) and not a.is_nested]
        return _CHOICES[zlib.crc32(f"{self.salt}|{op_key(op)}|{shapes}".encode()) % len(_CHOICES)]


@dataclasses.dataclass
class EveryK:
    """Saves every k-th op call of a forward (counted per ``ctx``), recomputes the others."""

    k: int
    offset: int

    def __post_init__(self) -> None:
        self.counts: dict[int, int] = {}

    def __call__(self, ctx: Any, _op: Any, *args: Any, **kwargs: Any) -> Any:
        n = self.counts.get(id(ctx), 0)
        self.counts[id(ctx)] = n + 1
        return CheckpointPolicy.MUST_SAVE if (n + self.offset) % self.k == 0 else CheckpointPolicy.PREFER_RECOMPUTE


#: The answers an ``Answers`` policy draws from, by name, with weights: CPU offload often (on CPU tensors sac2
#: treats it as a save, through code of its own; stock SAC recomputes), every other answer sometimes.
ANSWERS = {
    "MUST_CPU_OFFLOAD": 3, "PREFER_CPU_OFFLOAD": 3, "MUST_SAVE": 2, "PREFER_SAVE": 2, "MUST_RECOMPUTE": 1,
    "PREFER_RECOMPUTE": 1,
}  # fmt: skip


@dataclasses.dataclass
class Answers:
    """An answer per op, by ``op_key`` name (``{'aten.mm.default': 'MUST_CPU_OFFLOAD'}``); PREFER_RECOMPUTE for
    ops it does not name."""

    answers: dict[str, str]

    def __post_init__(self) -> None:
        self._by_key = {k: getattr(CheckpointPolicy, v) for k, v in self.answers.items()}

    def __call__(self, _ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        return self._by_key.get(op_key(op), CheckpointPolicy.PREFER_RECOMPUTE)


@dataclasses.dataclass
class Constant:
    """Always the same answer."""

    answer: Any

    def __call__(self, _ctx: Any, _op: Any, *args: Any, **kwargs: Any) -> Any:
        return self.answer


_PRESETS = {
    "llm": sac2.policies.llm,
    "every_other_matmul": sac2.policies.every_other_matmul,
    "compose(every_other_matmul, llm)": lambda: sac2.policies.compose(
        sac2.policies.every_other_matmul(), sac2.policies.llm()
    ),
}


@dataclasses.dataclass
class PolicySpec:
    """How to build a fresh policy (policies may count calls, so each run gets its own)."""

    kind: str  # "list", "answers", "hash", "every_k", "constant", "preset"
    ops: tuple[str, ...] = ()  # for "list" and "answers": op names (``aten.mm.default``) and ``region NAME``
    answers: tuple[str, ...] = ()  # for "answers": the answer (a ``CheckpointPolicy`` name) for each op of ``ops``
    pick: float = 0.0  # for "list"/"answers" before the ops are known: the fraction of ops seen that it keeps
    same: bool = False  # for "answers" before the ops are known: one answer for every op it keeps
    salt: int = 0
    k: int = 2
    answer: Any = True
    preset: str = ""

    def build(self, stock: bool = False) -> Any:
        """The policy object; ``stock=True`` leaves regions out of a list (stock torch cannot see them)."""
        if self.kind == "list":
            return [_op_of(name) for name in self.ops if not (stock and name.startswith("region "))]
        if self.kind == "answers":
            return Answers(dict(zip(self.ops, self.answers, strict=True)))
        if self.kind == "hash":
            return HashPolicy(self.salt)
        if self.kind == "every_k":
            return EveryK(self.k, self.salt % self.k)
        if self.kind == "constant":
            return Constant(self.answer)
        return _PRESETS[self.preset]()

    def source(self) -> str:
        if self.kind == "list":
            return "[" + ", ".join(_op_source(name) for name in self.ops) + "]"
        if self.kind == "answers":
            return f"tests.fuzz.programs.Answers({dict(zip(self.ops, self.answers, strict=True))!r})"
        if self.kind == "hash":
            return f"tests.fuzz.programs.HashPolicy(salt={self.salt})"
        if self.kind == "every_k":
            return f"tests.fuzz.programs.EveryK(k={self.k}, offset={self.salt % self.k})"
        if self.kind == "constant":
            return f"tests.fuzz.programs.Constant({self.answer})"
        return f"sac2.policies.{self.preset}()" if "(" not in self.preset else f"<preset {self.preset}>"


def _op_of(name: str) -> Any:
    if name.startswith("region "):
        return sac2.Region(name[len("region ") :])
    if name == "apply_twice":
        return apply_twice
    obj: Any = torch.ops
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def _op_source(name: str) -> str:
    if name.startswith("region "):
        return f"sac2.Region({name[len('region ') :]!r})"
    if "." not in name:
        return f"tests.fuzz.programs.{name}"
    return f"torch.ops.{name}"


def _random_policy(rng: random.Random) -> PolicySpec:
    kind = rng.choices(["list", "answers", "hash", "every_k", "constant", "preset"], [30, 30, 18, 8, 8, 10])[0]
    if kind == "list":
        return PolicySpec("list", pick=rng.choice([0.2, 0.5, 0.8, 1.0]), salt=rng.randrange(1 << 30))
    if kind == "answers":
        pick = rng.choice([0.3, 0.5, 0.8, 1.0])
        return PolicySpec("answers", pick=pick, same=rng.random() < 0.4, salt=rng.randrange(1 << 30))
    if kind == "hash":
        return PolicySpec("hash", salt=rng.randrange(1 << 30))
    if kind == "every_k":
        return PolicySpec("every_k", k=rng.choice([2, 3, 5]), salt=rng.randrange(10))
    if kind == "constant":
        return PolicySpec(
            "constant",
            answer=rng.choice(
                [True, False, CheckpointPolicy.MUST_CPU_OFFLOAD, CheckpointPolicy.PREFER_CPU_OFFLOAD]
            ),
        )
    return PolicySpec("preset", preset=rng.choice(sorted(_PRESETS)))


# ---- programs ----


@dataclasses.dataclass
class Var:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    group: int  # storage group: a tensor and its views share one
    view: bool = False  # a view (written through, it writes its base)
    expanded: bool = False  # no in-place writes (overlapping memory)


@dataclasses.dataclass
class InputSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool
    jagged: tuple[int, ...] = ()  # lengths of a nested jagged tensor's components (its shape is then (len, D))


@dataclasses.dataclass
class Program:
    seed: int
    inputs: list[InputSpec]
    statements: list[list[str]]  # each statement: a few lines of the function body
    outputs: list[str]
    policy: PolicySpec
    backward: str
    split: int = 1  # "split": how many outputs the first backward takes
    retain_first: bool = True  # "split": whether the first backward retains the graph
    out_mask: int = 1  # "grad_subset": bit j keeps the j-th output that requires grad (none kept: the last)
    in_mask: int = 1  # "inputs_subset": bit j keeps the j-th input that requires grad (none kept: the last)
    preserve_rng_state: bool = True
    kinds: tuple[str, ...] = ()
    gen_seed: int | None = None  # explicit generator ``gen``, made before the checkpointed call (``gen_random``)
    #: lines run on ``outs`` (the outputs) after the forward ended, before backward (``after_write``)
    epilogue: list[str] = dataclasses.field(default_factory=list)
    hooks: str = ""  # outer saved-tensor hooks around the checkpointed call (a ``HOOKS`` name), or none
    respect_hooks: bool | None = None  # ``respect_saved_tensors_hooks`` under ``hooks``

    def setup_source(self) -> str:
        """What runs before the checkpointed call, outside it: the explicit generator the function closes over."""
        return "" if self.gen_seed is None else f"gen = torch.Generator().manual_seed({self.gen_seed})\n"

    def epilogue_source(self) -> str:
        """``epilogue(outs)``: in-place writes to outputs or stashed intermediates after the forward ended."""
        if not self.epilogue:
            return ""
        return "def epilogue(outs):\n" + "".join(f"    {line}\n" for line in self.epilogue)

    def function_source(self) -> str:
        lines = [f"def program({', '.join(i.name for i in self.inputs)}):"]
        for statement in self.statements:
            lines += ["    " + line for line in statement]
        lines.append(f"    return ({''.join(o + ', ' for o in self.outputs)})")
        return "\n".join(lines) + "\n"

    def compile(self, ckpt: Callable[..., Any]) -> Callable[..., Any]:
        return self.compile_scope(ckpt)["program"]

    def compile_scope(self, ckpt: Callable[..., Any]) -> dict[str, Any]:
        """The namespace after running the setup and defining ``program`` (and ``epilogue``, if any)."""
        scope = namespace(ckpt)
        text = self.setup_source() + self.function_source() + self.epilogue_source()
        exec(compile(text, f"<fuzz program {self.seed}>", "exec"), scope)
        return scope

    def make_inputs(self) -> list[torch.Tensor]:
        """The inputs, drawn from a generator of their own (the global one is the programs')."""
        gen = torch.Generator().manual_seed(self.seed)
        out = []
        for spec in self.inputs:
            if spec.jagged:
                parts = [torch.randn(n, D, generator=gen, dtype=spec.dtype) for n in spec.jagged]
                t = torch.nested.nested_tensor(parts, layout=torch.jagged, requires_grad=spec.requires_grad)
            else:
                t = torch.randn(spec.shape, generator=gen, dtype=spec.dtype).requires_grad_(spec.requires_grad)
            out.append(t)
        return out

    def source(self) -> str:
        """The whole case as Python: inputs, function, policy and how it is run."""
        inputs = ", ".join(
            f"{i.name}: {'jagged' + str(list(i.jagged)) if i.jagged else list(i.shape)} {str(i.dtype)[6:]}"
            f"{' grad' if i.requires_grad else ''}"
            for i in self.inputs
        )
        split = {
            "split": f" split={self.split} retain_first={self.retain_first}",
            "grad_subset": f" out_mask={self.out_mask:#b}",
            "inputs_subset": f" in_mask={self.in_mask:#b}",
        }.get(self.backward, "")
        hooks = (
            f"# run under: with {HOOKS[self.hooks]}: ... respect_saved_tensors_hooks={self.respect_hooks}\n"
            if self.hooks
            else ""
        )
        after = "# after the forward, before backward: epilogue(outs)\n" if self.epilogue else ""
        return (
            f"# seed {self.seed}; inputs {inputs}\n"
            f"# policy = {self.policy.source()}\n"
            f"# backward={self.backward}{split} preserve_rng_state={self.preserve_rng_state}\n"
            + hooks
            + after
            + self.setup_source()
            + self.function_source()
            + self.epilogue_source()
        )


class Gen:
    """The state of one program being generated: its variables and what may still be written in place."""

    def __init__(self, rng: random.Random, dtype: torch.dtype, prefix: str = "v") -> None:
        self.rng = rng
        self.dtype = dtype
        self.prefix = prefix
        self.vars: list[Var] = []
        self.frozen: set[int] = set()  # groups some op saved for backward: writing them would break autograd
        self.statements: list[list[str]] = []
        self.kinds: list[str] = []
        self.no_grad = False
        self.autocast = False
        self.twice_ok = True
        self.epilogue: list[str] = []  # in-place writes after the forward (the ``after_write`` kind)
        self.stashed = 0  # how many intermediates the forward put into ``stash``
        self.after_outputs: list[tuple[Var, str]] = []  # outputs the epilogue writes, and how
        self.hooks = ""
        self.respect_hooks: bool | None = None
        self.grew_saved = False  # a ``resize_saved`` grew a saved tensor
        self._n = 0
        self._groups = 0
        self.depth = 0

    def new(self, shape: tuple[int, ...], dtype: torch.dtype | None = None, view_of: Var | None = None) -> Var:
        self._n += 1
        if view_of is None:
            self._groups += 1
        v = Var(
            f"{self.prefix}{self._n}",
            tuple(shape),
            dtype or self.dtype,
            view_of.group if view_of else self._groups + 1000 * self.depth,
        )
        v.view = view_of is not None
        v.expanded = bool(view_of and view_of.expanded)
        self.vars.append(v)
        return v

    def pick(self, pred: Callable[[Var], bool] = lambda _v: True) -> Var | None:
        cands = [v for v in self.vars if pred(v)]
        if not cands:
            return None
        # Prefer recent variables, so programs are chains rather than fans of the inputs.
        return cands[min(len(cands) - 1, int(len(cands) * (1 - self.rng.random() ** 2)))]

    def writable(self, v: Var) -> bool:
        return v.group not in self.frozen and not v.expanded

    def freeze(self, *vs: Var) -> None:
        self.frozen.update(v.group for v in vs)


Kind = Callable[[Gen], "list[str] | None"]


def _float(v: Var) -> bool:
    return v.dtype.is_floating_point


def _pair(g: Gen) -> tuple[Var, Var] | None:
    a = g.pick(_float)
    if a is None:
        return None
    b = g.pick(lambda v: _float(v) and _broadcast(a.shape, v.shape) is not None)
    return (a, b) if b is not None else None


def _broadcast(s: tuple[int, ...], t: tuple[int, ...]) -> tuple[int, ...] | None:
    try:
        return tuple(torch.broadcast_shapes(s, t))
    except RuntimeError:
        return None


def _promote(a: Var, b: Var) -> torch.dtype:
    return torch.promote_types(a.dtype, b.dtype)


def k_unary(g: Gen) -> list[str] | None:
    a = g.pick(_float)
    if a is None:
        return None
    fn = g.rng.choice(
        ["torch.sin", "torch.cos", "torch.exp", "torch.tanh", "torch.sigmoid", "F.gelu", "torch.relu", "torch.neg"]
    )
    out = g.new(a.shape, a.dtype)
    g.freeze(a, out) if fn != "torch.neg" else None
    return [f"{out.name} = {fn}({a.name})"]


def k_binary(g: Gen) -> list[str] | None:
    p = _pair(g)
    if p is None:
        return None
    a, b = p
    op = g.rng.choice(["+", "-", "*", "*"])
    out = g.new(_broadcast(a.shape, b.shape), _promote(a, b))
    if op == "*":
        g.freeze(a, b)
    return [f"{out.name} = {a.name} {op} {b.name}"]


def k_scalar(g: Gen) -> list[str] | None:
    a = g.pick(_float)
    if a is None:
        return None
    out = g.new(a.shape, a.dtype)
    return [f"{out.name} = {a.name} * {g.rng.choice([0.5, 2.0, -1.5])} + {g.rng.choice([0.25, 1.0])}"]


def _matmul_shapes(s: tuple[int, ...], t: tuple[int, ...]) -> tuple[int, ...] | None:
    if not s or not t or len(s) > 3 or len(t) > 3:
        return None
    if s[-1] != (t[0] if len(t) == 1 else t[-2]):
        return None
    try:
        return tuple(torch.matmul(torch.empty(s, device="meta"), torch.empty(t, device="meta")).shape)
    except RuntimeError:
        return None


def _mm_dtype(g: Gen, a: Var, b: Var) -> torch.dtype:
    if g.autocast and a.dtype != torch.float64 and b.dtype != torch.float64:
        return torch.bfloat16
    return a.dtype


def k_matmul(g: Gen) -> list[str] | None:
    a = g.pick(lambda v: _float(v) and 1 <= len(v.shape) <= 3)
    if a is None:
        return None
    b = g.pick(
        lambda v: _float(v) and (v.dtype == a.dtype or g.autocast) and _matmul_shapes(a.shape, v.shape) is not None
    )
    if b is None:
        return None
    out = g.new(_matmul_shapes(a.shape, b.shape), _mm_dtype(g, a, b))
    g.freeze(a, b)
    form = g.rng.choice(["{a} @ {b}", "torch.matmul({a}, {b})"])
    return [f"{out.name} = " + form.format(a=a.name, b=b.name)]


def k_linear(g: Gen) -> list[str] | None:
    a = g.pick(lambda v: _float(v) and len(v.shape) in (2, 3) and v.shape[-1] == D)
    w = a and g.pick(lambda v: (v.dtype == a.dtype or g.autocast) and v.shape == (D, D))
    if not w:
        return None
    bias = g.pick(lambda v: v.dtype == a.dtype and v.shape in ((D,), (a.shape[0], D))) if len(a.shape) == 2 else None
    out = g.new(a.shape, _mm_dtype(g, a, w))
    g.freeze(a, w)
    if bias is not None and g.rng.random() < 0.5:
        return [f"{out.name} = torch.addmm({bias.name}, {a.name}, {w.name})"]
    return [f"{out.name} = F.linear({a.name}, {w.name})"]


def k_reduce(g: Gen) -> list[str] | None:
    a = g.pick(lambda v: _float(v) and len(v.shape) >= 1)
    if a is None:
        return None
    fn, keep = g.rng.choice(
        [("sum", False), ("mean", False), ("amax", True), ("logsumexp", True), ("var", True), ("norm", True)]
    )
    if fn == "norm":
        out = g.new((), a.dtype)
        g.freeze(a, out)
        return [f"{out.name} = {a.name}.norm()"]
    keepdim = g.rng.random() < 0.5
    out = g.new(a.shape[:-1] + ((1,) if keepdim else ()), a.dtype)
    if keep:
        g.freeze(a, out)
    return [f"{out.name} = torch.{fn}({a.name}, dim=-1, keepdim={keepdim})"]


def k_view(g: Gen) -> list[str] | None:
    a = g.pick(lambda v: len(v.shape) >= 1)
    if a is None:
        return None
    s = a.shape
    options = [(f"{a.name}.unsqueeze(0)", (1,) + s), (f"{a.name}.flatten()", (_numel(s),))]
    if len(s) >= 2:
        options += [
            (f"{a.name}.transpose(-1, -2)", s[:-2] + (s[-1], s[-2])),
            (f"{a.name}[0]", s[1:]),
            (f"{a.name}[..., 1:3]", s[:-1] + (2,)),
            (f"{a.name}.diagonal(dim1=-2, dim2=-1)", s[:-2] + (min(s[-2:]),)),
        ]
    if len(s) == 2:
        options.append((f"{a.name}.t()", (s[1], s[0])))
    if s and s[0] == 1:
        options.append((f"{a.name}.squeeze(0)", s[1:]))
    if len(s) == 1:
        options.append((f"{a.name}.expand(2, {s[0]})", (2, s[0])))
    if s[0] >= 2:
        options.append((f"{a.name}[::2]", ((s[0] + 1) // 2,) + s[1:]))
    if a.dtype in (torch.float32, torch.float64):  # a cast to its own dtype returns the tensor itself
        options.append((f"{a.name}.{'float' if a.dtype == torch.float32 else 'double'}()", s))
    src, shape = g.rng.choice(options)
    out = g.new(shape, a.dtype, view_of=a)
    out.expanded = out.expanded or ".expand(" in src
    return [f"{out.name} = {src}"]


def _numel(s: tuple[int, ...]) -> int:
    n = 1
    for d in s:
        n *= d
    return n


def k_inplace(g: Gen) -> list[str] | None:
    if g.no_grad:
        return None
    a = g.pick(lambda v: _float(v) and g.writable(v))
    if a is None:
        return None
    b = g.pick(
        lambda v: _float(v) and v.dtype == a.dtype and _broadcast(a.shape, v.shape) == a.shape and v.group != a.group
    )
    forms = [f"{a.name}.mul_({g.rng.choice([0.5, 3.0])})", f"{a.name}.add_(1.0)", f"{a.name}.div_(2.0)"]
    if b is not None:
        forms += [f"{a.name}.add_({b.name})", f"{a.name}.sub_({b.name}, alpha=0.5)"]
    return [g.rng.choice(forms)]


def k_factory(g: Gen) -> list[str] | None:
    """A fresh tensor from a factory op, then written in place (so it joins the graph)."""
    if g.no_grad:
        return None
    a = g.pick(lambda v: _float(v) and len(v.shape) >= 1)
    if a is None:
        return None
    dt = str(a.dtype)
    make = g.rng.choice(
        [
            f"torch.zeros_like({a.name})",
            f"torch.ones_like({a.name})",
            f"torch.empty_like({a.name}).fill_(0.5)",
            f"torch.full({list(a.shape)}, 2.0, dtype={dt})",
            f"torch.zeros({list(a.shape)}, dtype={dt})",
            f"torch.ones({list(a.shape)}, dtype={dt})",
        ]
    )
    out = g.new(a.shape, a.dtype)
    write = g.rng.choice(
        [f"{out.name}.add_({a.name})", f"{out.name}.copy_({a.name})", f"{out.name}.addcmul_({a.name}, {a.name})"]
    )
    if "addcmul" in write:
        g.freeze(a)
    return [f"{out.name} = {make}", write]


def k_out(g: Gen) -> list[str] | None:
    """An ``out=`` op on detached values (autograd refuses out= with grad), then used with grad."""
    a = g.pick(lambda v: _float(v) and len(v.shape) >= 1)
    if a is None:
        return None
    o = g.new(a.shape, a.dtype)
    alloc = g.rng.choice(
        [
            f"torch.empty(0, dtype={a.dtype})",
            f"torch.empty_like({a.name})",
            f"{a.name}.new_empty(0)",
            f"torch.zeros({list(a.shape)}, dtype={a.dtype})",
        ]
    )
    d = f"{a.name}.detach()"
    forms = [
        f"torch.mul({d}, 2.0, out={o.name})",
        f"torch.sin({d}, out={o.name})",
        f"torch.add({d}, {d}, out={o.name})",
        f"torch.ops.aten.exp.out({d}, out={o.name})",
        f"torch.cumsum({d}, -1, out={o.name})",
        f"torch.ops.aten.addcmul.out({d}, {d}, {d}, value=0.5, out={o.name})",
    ]
    if len(a.shape) == 2 and a.shape[0] == a.shape[1]:
        forms.append(f"torch.mm({d}, {d}, out={o.name})")
    r = g.new(a.shape, a.dtype)
    g.freeze(a, o)
    use = g.rng.choice(
        [f"{a.name} * {o.name}", f"{a.name} + {o.name}.sin()", f"torch.where({o.name} > 0, {a.name}, 0.0)"]
    )
    return [f"{o.name} = {alloc}", g.rng.choice(forms), f"{r.name} = {use}"]


def k_out_multi(g: Gen) -> list[str] | None:
    """A two-output ``out=`` op (values and int64 indices) on detached values, writing into factory buffers, then
    both buffers read with grad: ``torch.gather`` with the indices, a product with the values."""
    a = g.pick(lambda v: _float(v) and len(v.shape) >= 1 and v.shape[-1] >= 2)
    if a is None:
        return None
    d = f"{a.name}.detach()"
    fn, shape = g.rng.choice(
        [
            ("torch.cummax({d}, -1, out=({v}, {i}))", a.shape),
            ("torch.cummin({d}, -1, out=({v}, {i}))", a.shape),
            ("torch.sort({d}, -1, out=({v}, {i}))", a.shape),
            ("torch.max({d}, -1, keepdim=True, out=({v}, {i}))", a.shape[:-1] + (1,)),
            ("torch.kthvalue({d}, 2, -1, keepdim=True, out=({v}, {i}))", a.shape[:-1] + (1,)),
        ]
    )
    v = g.new(shape, a.dtype)
    i = g.new(shape, torch.int64)
    g.vars.remove(i)  # only read here: later kinds would need int64-aware picks
    alloc_v = g.rng.choice([f"torch.empty(0, dtype={a.dtype})", f"{a.name}.new_empty(0)", f"torch.empty_like({d})"])
    alloc_i = g.rng.choice(["torch.empty(0, dtype=torch.int64)", f"{a.name}.new_empty(0, dtype=torch.int64)"])
    r1 = g.new(a.shape, a.dtype)
    r2 = g.new(shape, a.dtype)
    g.freeze(a, v)
    return [
        f"{v.name} = {alloc_v}",
        f"{i.name} = {alloc_i}",
        fn.format(d=d, v=v.name, i=i.name),
        f"{r1.name} = {a.name} * {v.name}",
        f"{r2.name} = torch.gather({a.name}, -1, {i.name})",
    ]


def k_rrelu(g: Gen) -> list[str] | None:
    """rrelu in training: ``rrelu_with_noise(self, Tensor(b!) noise, ...)`` writes its noise into an ``empty_like``
    buffer made just before it, and its backward reads that buffer (the in-place form writes ``self`` too).
    Never under the user's copying hooks: autograd packs ``noise``, an input, before the kernel writes it, so
    without checkpointing backward reads a copy of uninitialised memory (torch's result is not defined there)."""
    if g.hooks == "user":
        return None
    a = g.pick(_float)
    if a is None:
        return None
    out = g.new(a.shape, a.dtype)
    g.freeze(a, out)
    bounds = g.rng.choice(["", "0.1, 0.4, "])
    form = g.rng.choice(["F.rrelu", "torch.rrelu", "inplace", "torch.rrelu_"])
    if form == "inplace":
        call = f"F.rrelu({out.name}, {bounds}training=True, inplace=True)"
    elif form == "torch.rrelu_":
        call = f"torch.rrelu_({out.name}, {bounds}training=True)"
    else:
        return [f"{out.name} = {form}({a.name}, {bounds}training=True)"]
    return [f"{out.name} = {a.name} * {g.rng.choice([1.5, -0.5])}", call]  # a fresh tensor to write in place


def k_norm_stats(g: Gen) -> list[str] | None:
    """batch_norm / instance_norm in training, with running statistics that factory ops made inside the region:
    the norm writes them (``native_batch_norm``, whose schema does not mark them written; instance_norm
    ``copy_``s into them) and later ops read them."""
    a = g.pick(lambda v: _float(v) and v.dtype != torch.bfloat16 and len(v.shape) in (2, 3) and v.shape[:2] == (D, D))
    if a is None:
        return None
    dt = str(a.dtype)
    zeros = g.rng.choice(
        [
            f"torch.zeros({D}, dtype={dt})",
            f"{a.name}.new_zeros({D})",
            f"torch.empty({D}, dtype={dt}).zero_()",
            f"{a.name}.new_empty({D}).fill_(0.25)",
        ]
    )
    ones = g.rng.choice(
        [f"torch.ones({D}, dtype={dt})", f"{a.name}.new_ones({D})", f"torch.full(({D},), 2.0, dtype={dt})"]
    )
    rm, rv = g.new((D,), a.dtype), g.new((D,), a.dtype)
    momentum = g.rng.choice(["0.3", "1.0"])
    if len(a.shape) == 3 and g.rng.random() < 0.4:
        call = f"F.instance_norm({a.name}, {rm.name}, {rv.name}, use_input_stats=True, momentum=0.3)"
    else:
        w = g.pick(lambda v: v.shape == (D,) and v.dtype == a.dtype and v not in (rm, rv))
        affine = f"{w.name}, {w.name} * 0.5, " if w is not None and g.rng.random() < 0.5 else ""
        call = f"F.batch_norm({a.name}, {rm.name}, {rv.name}, {affine}training=True, momentum={momentum})"
    out = g.new(a.shape, a.dtype)
    r = g.new(a.shape, a.dtype)
    g.freeze(a, rm, rv, out)
    read = g.rng.choice([f"{out.name} * {rv.name} + {rm.name}", f"{out.name} + {rm.name}.exp() * {rv.name}"])
    return [f"{rm.name} = {zeros}", f"{rv.name} = {ones}", f"{out.name} = {call}", f"{r.name} = {read}"]


def k_index_write(g: Gen) -> list[str] | None:
    """An indexed in-place write (``scatter_add_``, ``index_put_``, ...) of a value with grad into a buffer a
    factory op made inside the region, then the buffer read."""
    if g.no_grad:
        return None
    a = g.pick(lambda v: _float(v) and len(v.shape) == 2 and v.shape[-1] == D)
    src = a and g.pick(lambda v: v.shape == a.shape and v.dtype == a.dtype)
    if not src:
        return None
    rows, dt, shape = a.shape[0], a.dtype, list(a.shape)
    make = g.rng.choice(
        [
            f"torch.zeros_like({a.name})",
            f"{a.name}.new_zeros({shape})",
            f"torch.zeros({shape}, dtype={dt})",
            f"torch.empty_like({a.name}).zero_()",
            f"torch.full({shape}, 0.5, dtype={dt})",
        ]
    )
    buf = g.new(a.shape, dt)
    cols = [[g.rng.randrange(D) for _ in range(D)] for _ in range(rows)]
    perm = [g.rng.sample(range(D), D) for _ in range(rows)]
    at = [g.rng.randrange(rows) for _ in range(rows)]
    write = g.rng.choice(
        [
            f"{buf.name}.scatter_add_(1, torch.tensor({cols}), {src.name})",
            f"{buf.name}.scatter_(1, torch.tensor({perm}), {src.name})",
            f"{buf.name}.index_put_((torch.tensor({at}),), {src.name}, accumulate=True)",
            f"{buf.name}.index_add_(0, torch.tensor({at}), {src.name}, alpha=2.0)",
            f"{buf.name}.index_copy_(0, torch.tensor({g.rng.sample(range(rows), rows)}), {src.name})",
            f"{buf.name}.masked_scatter_({src.name}.detach() > 0, {src.name})",
        ]
    )
    c = g.pick(lambda v: v.shape == a.shape and v.dtype == dt and v is not buf)
    read, out_shape = g.rng.choice(
        [
            (f"{buf.name} * {c.name}", a.shape),
            (f"torch.tanh({buf.name})", a.shape),
            (f"{buf.name} @ {c.name}.t()", (rows, rows)),
        ]
    )
    out = g.new(out_shape, dt)
    g.freeze(src, buf, c, out)
    return [f"{buf.name} = {make}", write, f"{out.name} = {read}"]


def k_fill(g: Gen) -> list[str] | None:
    """A factory buffer filled in place by a random op (``exponential_``, ``uniform_``, ...), maybe scaled in
    place as dropout's mask is, then read by a product whose backward reads it too."""
    a = g.pick(lambda v: _float(v) and len(v.shape) >= 1)
    if a is None:
        return None
    make = g.rng.choice(
        [
            f"torch.empty_like({a.name})",
            f"{a.name}.new_empty({list(a.shape)})",
            f"torch.empty({list(a.shape)}, dtype={a.dtype})",
            f"torch.zeros_like({a.name})",
        ]
    )
    fill = g.rng.choice(
        [
            "exponential_()", "exponential_(2.0)", "uniform_(-1.0, 1.0)", "normal_()", "normal_(0.5, 2.0)",
            "cauchy_()", "log_normal_()", "geometric_(0.3)", "random_(0, 3)", "bernoulli_(0.5)",
        ]
    )  # fmt: skip
    n = g.new(a.shape, a.dtype)
    out = g.new(a.shape, a.dtype)
    g.freeze(a, n)
    lines = [f"{n.name} = {make}.{fill}"] if g.rng.random() < 0.5 else [f"{n.name} = {make}", f"{n.name}.{fill}"]
    if g.rng.random() < 0.3:
        lines.append(f"{n.name}.div_(0.7)")
    return lines + [f"{out.name} = {a.name} * {n.name}"]


def k_buffered(g: Gen) -> list[str] | None:
    """Functional ops that make a buffer inside and write it (``log_sigmoid_forward``'s buffer, indices of
    ``cummax``/``sort``/``max_pool``, ``nll_loss``'s total weight, ``fractional_max_pool``'s random samples),
    read by their backward."""
    a = g.pick(lambda v: _float(v) and len(v.shape) >= 1 and v.shape[-1] >= 2)
    if a is None:
        return None
    s, n = a.shape, a.name
    forms = [
        (f"F.logsigmoid({n})", s),
        (f"torch.cummax({n}, -1).values", s),
        (f"torch.cummin({n}, -1)[0]", s),
        (f"torch.sort({n}, -1, descending=True).values", s),
        (f"torch.kthvalue({n}, 2, -1, keepdim=True).values", s[:-1] + (1,)),
        (f"torch.topk({n}, 2).values", s[:-1] + (2,)),
    ]
    if len(s) in (2, 3) and s[-1] % 2 == 0:
        forms.append((f"F.max_pool1d({n}, 2, return_indices=True)[0]", s[:-1] + (s[-1] // 2,)))
    if len(s) == 2 and s[-1] == D and a.dtype != torch.bfloat16:
        idx = [g.rng.randrange(D) for _ in range(s[0])]
        forms.append((f"F.nll_loss(F.log_softmax({n}, -1), torch.tensor({idx}), reduction='sum')", ()))
        forms.append((f"F.multilabel_margin_loss({n}, torch.tensor({[idx[:1] + [-1] * (D - 1)] * s[0]}))", ()))
    if len(s) in (2, 3) and s[-2:] == (D, D) and a.dtype != torch.bfloat16:
        forms.append((f"F.fractional_max_pool2d({n}{'.unsqueeze(0)' if len(s) == 2 else ''}, 2, output_size=2)",
                      (1 if len(s) == 2 else s[0], 2, 2)))  # fmt: skip
    src, shape = g.rng.choice(forms)
    if "multilabel" in src:
        g.twice_ok = False  # multilabel_margin_loss_backward has no derivative
    out = g.new(shape, a.dtype)
    g.freeze(a, out)
    return [f"{out.name} = {src}"]


def k_random(g: Gen) -> list[str] | None:
    a = g.pick(_float)
    if a is None:
        return None
    out = g.new(a.shape, a.dtype)
    form = g.rng.choice(
        [
            "F.dropout({a}, p=0.3, training=True)",
            "{a} * torch.rand_like({a})",
            "{a} + torch.randn_like({a})",
            "{a} * torch.empty_like({a}).bernoulli_(0.5)",
            "{a} + torch.rand({shape}, dtype={dt})",
            "F.alpha_dropout({a}, p=0.3, training=True)",
        ]
        + (["F.dropout1d({a}, p=0.5, training=True)"] if len(a.shape) in (2, 3) else [])
    )
    g.freeze(a)
    return [f"{out.name} = " + form.format(a=a.name, shape=list(a.shape), dt=a.dtype)]


def k_nn(g: Gen) -> list[str] | None:
    a = g.pick(lambda v: _float(v) and len(v.shape) in (2, 3) and v.shape[-1] == D)
    if a is None:
        return None
    choice = g.rng.choice(["softmax", "log_softmax", "layer_norm", "sdpa", "embedding"])
    if choice == "sdpa":
        k = g.pick(lambda v: v.shape == a.shape and v.dtype == a.dtype)
        drop = g.rng.choice([0.0, 0.0, 0.25])
        out = g.new(a.shape, a.dtype)
        g.freeze(a, k, out)
        return [f"{out.name} = F.scaled_dot_product_attention({a.name}, {k.name}, {k.name}, dropout_p={drop})"]
    if choice == "embedding":
        w = g.pick(lambda v: v.shape == (D, D) and _float(v))
        if w is None:
            return None
        out = g.new((2, D), w.dtype)
        idx = [g.rng.randrange(D) for _ in range(2)]
        return [f"{out.name} = F.embedding(torch.tensor({idx}), {w.name})"]
    out = g.new(a.shape, a.dtype)
    g.freeze(a, out)
    if choice == "layer_norm":
        return [f"{out.name} = F.layer_norm({a.name}, ({D},))"]
    return [f"{out.name} = torch.{choice}({a.name}, dim=-1)"]


def k_combine(g: Gen) -> list[str] | None:
    a = g.pick(lambda v: _float(v) and len(v.shape) == 2 and v.shape[-1] == D)
    b = a and g.pick(lambda v: v.shape == a.shape and v.dtype == a.dtype)
    if not b:
        return None
    choice = g.rng.choice(["cat", "where", "gather", "scatter"])
    rows = a.shape[0]
    idx = [[g.rng.randrange(D) for _ in range(D)] for _ in range(rows)]
    if choice == "cat":
        out = g.new((rows, 2 * D), _promote(a, b))
        return [f"{out.name} = torch.cat([{a.name}, {b.name}], dim=-1)"]
    out = g.new(a.shape, a.dtype)
    if choice == "where":
        return [f"{out.name} = torch.where({a.name} > 0, {a.name}, {b.name})"]
    if choice == "gather":
        g.freeze(a)
        return [f"{out.name} = torch.gather({a.name}, 1, torch.tensor({idx}))"]
    perm = [g.rng.sample(range(D), D) for _ in range(rows)]
    return [f"{out.name} = torch.scatter({a.name}, 1, torch.tensor({perm}), {b.name})"]


def k_meta_inplace(g: Gen) -> list[str] | None:
    """``t_``, ``transpose_``, ``unsqueeze_``, ``squeeze_`` on a fresh intermediate."""
    if g.no_grad:
        return None
    a = g.pick(lambda v: _float(v) and len(v.shape) >= 1)
    if a is None:
        return None
    t = g.new(a.shape, a.dtype)
    lines = [f"{t.name} = {a.name} {g.rng.choice(['* 1.5', '+ 0.5'])}"]
    s = a.shape
    if len(s) == 2 and g.rng.random() < 0.5:
        lines.append(f"{t.name}.t_()")
        t.shape = (s[1], s[0])
    elif len(s) >= 2:
        lines.append(f"{t.name}.transpose_(0, 1)")
        t.shape = (s[1], s[0]) + s[2:]
    else:
        lines += [f"{t.name}.unsqueeze_(0)"]
        t.shape = (1,) + s
        if g.rng.random() < 0.5:
            lines.append(f"{t.name}.squeeze_(0)")
            t.shape = s
    g.freeze(t)  # later in-place writes would go into a tensor whose metadata was written in place: kept simple
    return lines


def k_custom(g: Gen) -> list[str] | None:
    a = g.pick(_float)
    if a is None:
        return None
    if g.rng.random() < 0.5 or g.no_grad:
        out = g.new(a.shape, a.dtype)
        return [f"{out.name} = torch.ops.sac2_fuzz.scale({a.name}, {g.rng.choice([0.5, 3.0])})"]
    buf = g.new(a.shape, a.dtype)
    out = g.new(a.shape, a.dtype)
    g.freeze(a, buf)  # the product saves buf for backward
    return [
        f"{buf.name} = torch.zeros_like({a.name}.detach())",
        f"torch.ops.sac2_fuzz.add_into_({buf.name}, {a.name}.detach().cos())",
        f"{out.name} = {a.name} * {buf.name}",
    ]


def k_function(g: Gen) -> list[str] | None:
    a = g.pick(_float)
    if a is None:
        return None
    out = g.new(a.shape, a.dtype)
    g.freeze(a)
    return [f"{out.name} = Cube.apply({a.name})"]


def k_hop(g: Gen) -> list[str] | None:
    a = g.pick(_float)
    if a is None:
        return None
    out = g.new(a.shape, a.dtype)
    g.freeze(a)
    g.twice_ok = False
    return [f"{out.name} = apply_twice({g.rng.choice(['torch.sin', 'noisy'])}, {a.name})"]


def k_region(g: Gen) -> list[str] | None:
    a = g.pick(_float)
    if a is None:
        return None
    out = g.new(a.shape, a.dtype)
    g.freeze(a, out)
    return [f"{out.name} = {g.rng.choice(sorted(REGIONS))}({a.name})"]


def _block(g: Gen, header: str, flag: str, kinds: list[str]) -> list[str] | None:
    setattr(g, flag, True)
    body: list[str] = []
    try:
        for _ in range(g.rng.randint(1, 2)):
            lines = KINDS[g.rng.choice(kinds)](g)
            if lines:
                body += lines
    finally:
        setattr(g, flag, False)
    return [header] + ["    " + line for line in body] if body else None


def k_no_grad(g: Gen) -> list[str] | None:
    n = len(g.vars)
    lines = _block(g, "with torch.no_grad():", "no_grad", [
        "unary", "binary", "matmul", "random", "custom", "fill", "rrelu"
    ])  # fmt: skip
    for v in g.vars[n:]:
        v.expanded = True  # made under no_grad: in-place writes later are fine, but keep it simple
    return lines


def k_autocast(g: Gen) -> list[str] | None:
    return _block(
        g, "with torch.autocast('cpu', dtype=torch.bfloat16):", "autocast", ["matmul", "linear", "unary", "binary"]
    )


def k_nested(g: Gen) -> list[str] | None:
    """A nested checkpoint around a few ops of their own."""
    if g.depth >= 1 or g.no_grad or g.autocast:
        return None
    args = []
    for _ in range(g.rng.randint(1, 2)):
        a = g.pick(lambda v: _float(v) and v not in args)
        if a is not None:
            args.append(a)
    if not args:
        return None
    sub = Gen(g.rng, g.dtype, prefix=f"i{len(g.statements)}_")
    sub.depth = g.depth + 1
    sub.hooks = g.hooks  # what the body's kinds may combine with (k_rrelu)
    params = [sub.new(a.shape, a.dtype) for a in args]
    sub.freeze(*params)
    body = []
    for _ in range(g.rng.randint(1, 4)):
        kind = g.rng.choice(NESTABLE)
        lines = KINDS[kind](sub)
        if lines:
            body += lines
            g.kinds.append(kind)
    g.twice_ok &= sub.twice_ok
    g.grew_saved |= sub.grew_saved
    result = sub.vars[-1]
    name = f"inner{len(g.statements)}"
    out = g.new(result.shape, result.dtype)
    g.freeze(*args, out)
    return (
        [f"def {name}({', '.join(p.name for p in params)}):"]
        + ["    " + line for line in body]
        + [f"    return {result.name}", f"{out.name} = ckpt({name}, {', '.join(a.name for a in args)})"]
    )


# ---- kinds of issue 25: explicit generators, writes to saved tensors, writes after forward, outer hooks ----


def k_gen_random(g: Gen) -> list[str] | None:
    """A random op drawing from the explicit generator ``gen`` that the case's setup makes outside the checkpointed
    function (closed over): a recompute must draw what the forward drew, and leave ``gen`` where it would be."""
    a = g.pick(_float)
    if a is None:
        return None
    shape, dt = list(a.shape), a.dtype
    form = g.rng.choice(
        [
            "torch.randn({shape}, generator=gen, dtype={dt})",
            "torch.rand({shape}, generator=gen, dtype={dt})",
            "torch.empty({shape}, dtype={dt}).uniform_(-1.0, 1.0, generator=gen)",
            "torch.empty_like({a}).normal_(generator=gen)",
            "torch.bernoulli(torch.full({shape}, 0.5, dtype={dt}), generator=gen)",
            "torch.bernoulli({a}.detach().sigmoid(), generator=gen)",
            "torch.randint(0, 3, {shape}, generator=gen).to({dt})",
        ]
    )
    n = g.new(a.shape, a.dtype)
    out = g.new(a.shape, a.dtype)
    g.freeze(a, n)
    op = g.rng.choice(["*", "+"])
    return [f"{n.name} = " + form.format(a=a.name, shape=shape, dt=dt), f"{out.name} = {a.name} {op} {n.name}"]


def k_saved_write(g: Gen) -> list[str] | None:
    """An in-place write to a tensor an op saved earlier in the same forward (``n = x * 2; y = sin(n);
    n.add_(1)``): without checkpointing autograd raises at backward, and so must a checkpoint."""
    if g.no_grad:
        return None
    a = g.pick(_float)
    if a is None:
        return None
    n = g.new(a.shape, a.dtype)
    y = g.new(a.shape, a.dtype)
    b = g.pick(lambda v: _float(v) and v.dtype == a.dtype and _broadcast(a.shape, v.shape) == a.shape)
    save = g.rng.choice(["torch.sin({n})", "{n} * {n}", "torch.cos({n})", "{n}.pow(2)"] + (["{n} * {b}"] if b else []))
    write = g.rng.choice(
        ["{n}.add_(1.0)", "{n}.mul_(2.0)", "{n}.zero_()"] + (["{n}[0].add_(1.0)"] if a.shape else [])
    )
    g.freeze(n, y)
    return [
        f"{n.name} = {a.name} {g.rng.choice(['* 2', '+ 0.5'])}",
        f"{y.name} = " + save.format(n=n.name, b=b.name if b else ""),
        write.format(n=n.name),
    ]


def k_resize_saved(g: Gen) -> list[str] | None:
    """``resize_`` of a tensor (no grad of its own) that a product saved for the other factor's gradient."""
    if g.no_grad:
        return None
    a = g.pick(lambda v: _float(v) and len(v.shape) >= 1)
    b = a and g.pick(lambda v: _float(v) and v.shape == a.shape and v.dtype == a.dtype)
    if not b:
        return None
    n = g.new(a.shape, a.dtype)
    y = g.new(a.shape, a.dtype)
    g.freeze(b, y)
    # Growing it under hooks that keep the tensor itself (save_on_cpu on CPU) would have backward read the new,
    # uninitialised elements: torch's own result is not defined there (so k_hooks then leaves save_on_cpu out).
    sizes = [[1]] if g.hooks == "save_on_cpu" else [[2 * _numel(a.shape)], [1], [2, _numel(a.shape)]]
    size = g.rng.choice(sizes)
    g.grew_saved |= size != [1]
    lines = [f"{n.name} = {a.name}.detach() * 2", f"{y.name} = {b.name} * {n.name}", f"{n.name}.resize_({size})"]
    g.vars.remove(n)  # its shape changed: later kinds would need to know the new one
    return lines


def k_out_later(g: Gen) -> list[str] | None:
    """An ``out=`` buffer (``torch.mul(a, b, out=buf)`` on detached values) that a later product saves, then
    written in place (``buf.clamp_``) before backward."""
    if g.no_grad:
        return None
    p = _pair(g)
    if p is None:
        return None
    a, b = p
    shape, dt = _broadcast(a.shape, b.shape), _promote(a, b)
    buf = g.new(shape, dt)
    y = g.new(shape, dt)
    alloc = g.rng.choice([f"torch.empty(0, dtype={dt})", f"torch.empty({list(shape)}, dtype={dt})"])
    write = g.rng.choice([f"{buf.name}.clamp_(-0.5, 0.5)", f"{buf.name}.mul_(0.5)", f"{buf.name}.neg_()"])
    g.freeze(buf, y)
    return [
        f"{buf.name} = {alloc}",
        f"torch.mul({a.name}.detach(), {b.name}.detach(), out={buf.name})",
        f"{y.name} = {buf.name} * {a.name}",
        write,
    ]


def k_after_write(g: Gen) -> list[str] | None:
    """A tensor autograd saved, written in place by the case's epilogue after the forward ended, before backward:
    an intermediate the forward put into ``stash`` (saved by ``sin``), or an output (``exp`` saves its result)."""
    if g.no_grad or g.depth > 0:
        return None
    a = g.pick(_float)
    if a is None:
        return None
    write = g.rng.choice(["add_(1.0)", "mul_(2.0)", "zero_()"])
    if g.rng.random() < 0.5:
        n = g.new(a.shape, a.dtype)
        y = g.new(a.shape, a.dtype)
        g.freeze(n, y)
        g.epilogue.append(f"stash[{g.stashed}].{write}")
        g.stashed += 1
        return [f"{n.name} = {a.name} * 1.5", f"{y.name} = torch.sin({n.name})", f"stash.append({n.name})"]
    y = g.new(a.shape, a.dtype)
    g.freeze(a, y)
    g.after_outputs.append((y, write))
    return [f"{y.name} = {g.rng.choice(['torch.exp', 'torch.tanh', 'torch.sigmoid'])}({a.name})"]


def k_hooks(g: Gen) -> list[str] | None:
    """Outer saved-tensor hooks around the checkpointed call (``save_on_cpu``, or a user pack that copies to other
    strides), with ``respect_saved_tensors_hooks`` True or False: a statement that is only a comment."""
    if g.depth > 0 or g.hooks:
        return None
    # Not the user's copying hooks after rrelu (k_rrelu), nor save_on_cpu after a saved tensor grew (k_resize_saved).
    refused = {"user": "rrelu" in g.kinds, "save_on_cpu": g.grew_saved}
    allowed = [h for h in sorted(HOOKS) if not refused[h]]
    if not allowed:
        return None
    g.hooks = g.rng.choice(allowed)
    g.respect_hooks = g.rng.random() < 0.5
    return [f"# the call runs under {g.hooks}, respect_saved_tensors_hooks={g.respect_hooks}"]


KINDS: dict[str, Kind] = {
    "unary": k_unary,
    "binary": k_binary,
    "scalar": k_scalar,
    "matmul": k_matmul,
    "linear": k_linear,
    "reduce": k_reduce,
    "view": k_view,
    "inplace": k_inplace,
    "factory": k_factory,
    "out": k_out,
    "out_multi": k_out_multi,
    "rrelu": k_rrelu,
    "norm_stats": k_norm_stats,
    "index_write": k_index_write,
    "fill": k_fill,
    "buffered": k_buffered,
    "random": k_random,
    "nn": k_nn,
    "combine": k_combine,
    "meta_inplace": k_meta_inplace,
    "custom": k_custom,
    "function": k_function,
    "hop": k_hop,
    "region": k_region,
    "no_grad": k_no_grad,
    "autocast": k_autocast,
    "nested": k_nested,
    "gen_random": k_gen_random,
    "saved_write": k_saved_write,
    "resize_saved": k_resize_saved,
    "out_later": k_out_later,
    "after_write": k_after_write,
    "hooks": k_hooks,
}
WEIGHTS = {
    "unary": 10, "binary": 10, "scalar": 4, "matmul": 10, "linear": 5, "reduce": 4, "view": 8, "inplace": 8,
    "factory": 4, "out": 3, "random": 6, "nn": 5, "combine": 4, "meta_inplace": 3, "custom": 3, "function": 2,
    "hop": 2, "region": 3, "no_grad": 2, "autocast": 2, "nested": 3, "out_multi": 2, "rrelu": 3, "norm_stats": 3,
    "index_write": 3, "fill": 3, "buffered": 3, "gen_random": 5, "saved_write": 2, "resize_saved": 1,
    "out_later": 1, "after_write": 2, "hooks": 4,
}  # fmt: skip
NESTABLE = [k for k in KINDS if k not in ("nested", "no_grad", "autocast", "after_write", "hooks")]
_NJT_KINDS = ["njt_unary", "njt_scalar", "njt_binary", "njt_linear", "njt_layer_norm"]


def _njt_step(g: Gen, kind: str) -> list[str] | None:
    a, b = g.pick(), g.pick()
    out = g.new(a.shape, a.dtype)
    if kind == "njt_unary":
        return [f"{out.name} = {g.rng.choice(['torch.sin', 'torch.tanh', 'torch.relu', 'torch.exp'])}({a.name})"]
    if kind == "njt_scalar":
        return [f"{out.name} = {a.name} * {g.rng.choice([0.5, 2.0])}"]
    if kind == "njt_binary":
        return [f"{out.name} = {a.name} {g.rng.choice(['+', '*'])} {b.name}"]
    if kind == "njt_linear":
        return [f"{out.name} = F.linear({a.name}, w)"]
    return [f"{out.name} = F.layer_norm({a.name}, ({D},))"]


def _njt_program(seed: int, rng: random.Random, policy: PolicySpec) -> Program:
    dtype = rng.choice([torch.float64, torch.float32])
    g = Gen(rng, dtype)
    g.new((0, D), dtype).name = "x0"
    lengths = tuple(rng.randint(1, 3) for _ in range(rng.randint(1, 3)))
    inputs = [InputSpec("x0", (0, D), dtype, True, jagged=lengths), InputSpec("w", (D, D), dtype, True)]
    for _ in range(rng.randint(2, 6)):
        kind = rng.choice(_NJT_KINDS)
        g.statements.append(_njt_step(g, kind))
        g.kinds.append(kind)
    return Program(
        seed,
        inputs,
        g.statements,
        [g.vars[-1].name],
        policy,
        rng.choice(["grad", "backward", "no_grad"]),
        kinds=tuple(g.kinds) + ("njt",),
    )


def generate(seed: int) -> Program:
    """The program of ``seed``: mostly float64, some float32; one in fifteen takes a nested jagged tensor."""
    rng = random.Random(seed)
    policy = _random_policy(rng)
    if rng.random() < 1 / 15:
        program = _njt_program(seed, rng, policy)
    else:
        dtype = torch.float64 if rng.random() < 0.75 else torch.float32
        g = Gen(rng, dtype)
        inputs = []
        layouts: list[list[tuple[int, ...]]] = [
            [(D, D), (D, D)], [(D, D), (2, D, D), (D, D)], [(D,), (D, D)], [(2, D, D), (D,), (D, D)]
        ]
        for i, shape in enumerate(rng.choice(layouts)):
            v = g.new(shape, dtype)
            v.name = f"x{i}"
            inputs.append(InputSpec(v.name, shape, dtype, requires_grad=rng.random() < 0.9))
        g.freeze(*g.vars)  # inputs are leaves (or checkpoint inputs): never written in place
        names, weights = zip(*WEIGHTS.items(), strict=True)
        for _ in range(rng.randint(3, 14)):
            kind = rng.choices(names, weights)[0]
            lines = KINDS[kind](g)
            if lines:
                g.statements.append(lines)
                g.kinds.append(kind)
        made = [v.name for v in g.vars if v.name.startswith("v")]
        if not made:
            out = g.new(g.vars[-1].shape, g.vars[-1].dtype)
            g.statements.append([f"{out.name} = {g.vars[-2].name} * 2"])
            made = [out.name]
        written = [v.name for v, _ in g.after_outputs]
        outputs = sorted(
            set([made[-1]] + written + rng.sample(made, min(len(made), rng.randint(0, 2)))), key=made.index
        )
        epilogue = g.epilogue + [f"outs[{outputs.index(v.name)}].{write}" for v, write in g.after_outputs]
        styles = [s for s in BACKWARDS if s not in DOUBLE or g.twice_ok]
        program = Program(seed, inputs, g.statements, outputs, policy, rng.choice(styles), kinds=tuple(g.kinds))
        program.epilogue = epilogue
        program.hooks, program.respect_hooks = g.hooks, g.respect_hooks
        if any("generator=gen" in line for statement in g.statements for line in statement):
            program.gen_seed = rng.randrange(1 << 20)
        program.split = rng.randint(1, max(1, len(outputs) - 1)) if len(outputs) > 1 else 1
        program.retain_first = rng.random() < 0.7
        program.out_mask = rng.randrange(1, 1 << len(outputs)) if len(outputs) > 1 else 1
        program.in_mask = rng.randrange(1, 1 << len(inputs))
    program.preserve_rng_state = rng.random() < 0.85
    return program


def iter_kinds() -> Iterator[str]:
    """Every op kind a program can contain (for the coverage line of the long mode's report)."""
    yield from KINDS
    yield from _NJT_KINDS
