"""CPU offload: CPU_OFFLOAD policies on CPU tensors (they save: there is no device memory to free), and
``apply_ac(offload=...)`` through the CPU stand-in for a device (``sac2.offload.standin``): what it moves, that the
gradients are bitwise those of saving the same tensors, and that the frame's rules (in-place checks, nesting) hold
for what moved. The order of the copies is ``test_offload_schedule.py``'s."""

import copy
import functools
import warnings

import pytest
import torch
import torch.nn.functional as F
from expecttest import assert_expected_inline
from torch import nn

import sac2
from sac2.api import offload_targets
from sac2.core.decisions import CheckpointPolicy, SaveList
from sac2.measure.memory import Memory, measure_step
from sac2.offload import schedule
from sac2.offload.standin import stand_in

from helpers import COUNTED, contexts, counted_op, randn

counted, counted_runs = counted_op("test_offload")
aten = torch.ops.aten


def _f(x):
    return counted(x.sin()).cos()  # cos keeps its input, counted's output: backward needs it served or re-run


def _offload_counted(policy):
    def fn(_ctx, op, *args, **kwargs):
        return policy if op is COUNTED else CheckpointPolicy.PREFER_RECOMPUTE

    return fn


def _run(policy):
    x = randn(8)
    before = counted_runs()
    out = sac2.checkpoint(_f, x, context_fn=contexts(policy))
    (grad,) = torch.autograd.grad(out.sum(), x)
    return grad, counted_runs() - before


def _step_memory(answer: CheckpointPolicy) -> Memory:
    x = randn(1024)
    memory, _ = measure_step(lambda: sac2.checkpoint(_f, x, context_fn=contexts(_offload_counted(answer))).sum(), "cpu")
    return memory


def test_must_cpu_offload_saves_the_output():
    grad, runs = _run(_offload_counted(CheckpointPolicy.MUST_CPU_OFFLOAD))
    assert runs == 1  # forward only: backward served the kept output


def test_prefer_cpu_offload_saves_the_output():
    grad, runs = _run(_offload_counted(CheckpointPolicy.PREFER_CPU_OFFLOAD))
    assert runs == 1


def test_gradients_match_no_checkpoint_bit_for_bit():
    grad, _ = _run(_offload_counted(CheckpointPolicy.MUST_CPU_OFFLOAD))
    x = randn(8)
    (want,) = torch.autograd.grad(_f(x).sum(), x)
    assert torch.equal(grad, want)


def test_a_cpu_entry_keeps_the_one_output_it_saves():
    x = randn(1024)
    kept = sac2.activation_memory(_f, (x,), _offload_counted(CheckpointPolicy.MUST_CPU_OFFLOAD))
    assert kept == x.nbytes  # counted's output, and nothing else


def test_a_cpu_entry_costs_what_an_ordinary_save_costs_and_copies_nothing():
    offloaded = _step_memory(CheckpointPolicy.MUST_CPU_OFFLOAD)
    saved = _step_memory(CheckpointPolicy.MUST_SAVE)
    recomputed = _step_memory(CheckpointPolicy.PREFER_RECOMPUTE)
    assert offloaded == saved  # kept and peak: no host copy was made or kept
    assert offloaded.kept - recomputed.kept == 1024 * 4


# ---- apply_ac(offload=...) ----

D, T, B = 16, 8, 2


class Attention(nn.Module):
    """No parameters, a class name ending in ``Attention``: ``"attention"`` makes its calls regions. SDPA's CPU
    kernel keeps its output and logsumexp for backward: a saved region keeps them for real."""

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(D)
        self.qkv = nn.Linear(D, 3 * D, bias=False)
        self.attention = Attention()
        self.out = nn.Linear(D, D, bias=False)
        self.up, self.down = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).view(B, T, 3, 2, D // 2).permute(2, 0, 3, 1, 4)
        x = x + self.out(self.attention(q, k, v).transpose(1, 2).reshape(B, T, D))
        return x + self.down(F.gelu(self.up(x)))


class Net(nn.Module):
    def __init__(self, n=3):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(D, D)
        self.layers = nn.ModuleList(Layer() for _ in range(n))

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return x.square().mean()


def _x():
    return torch.randn(B, T, D, generator=torch.Generator().manual_seed(5))


def _train(model, steps=2):
    """``steps`` forward+backward passes; every parameter's gradient after each."""
    out = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        model(_x()).backward()
        out.append([p.grad.clone() for p in model.parameters()])
    return out


def _same(a, b):
    return all(torch.equal(x, y) for xs, ys in zip(a, b, strict=True) for x, y in zip(xs, ys, strict=True))


def _moved(link):
    return [label for kind, label in link.log if kind == "to_host"]


@pytest.mark.parametrize(("mode", "kwargs", "saving"), [
    ("full", {"offload": ["inputs"]}, {}),
    ("regions", {"save": ["linear"], "offload": ["attention"]}, {"save": ["linear", "attention"]}),
    ("regions", {"offload": ["inputs", "attention", "linear"]}, {"save": ["attention", "linear"]}),
    ("selective", {"offload": ["inputs", aten.mm.default]}, {"policy": [aten.mm.default, aten.addmm.default]}),
    ("selective", {"policy": [aten.addmm.default], "offload": [aten.mm.default]},
     {"policy": [aten.mm.default, aten.addmm.default]}),
    ("full", {"offload": ["attention"]}, None),
], ids=["full-inputs", "regions-attention", "regions-all", "selective-llm-inputs-mm", "selective-list-mm",
        "full-attention"])
def test_offload_gives_the_gradients_of_saving_the_same_tensors(mode, kwargs, saving):
    base = Net()
    offloaded, saved = copy.deepcopy(base), copy.deepcopy(base)
    with stand_in() as link:
        sac2.apply_ac(offloaded, mode, **kwargs)
        got = _train(offloaded)
    assert _moved(link)  # something went to the host and back
    if saving is None:  # attention saved, everything else recomputed: the regions mode with attention alone
        sac2.apply_ac(saved, "regions", save=["attention"])
    else:
        sac2.apply_ac(saved, mode, **saving)
    assert _same(got, _train(saved))


def test_offloaded_inputs_are_each_blocks_activation_input_and_the_last_block_keeps_its_own():
    model = Net()
    with stand_in() as link:
        sac2.apply_ac(model, "full", offload=["inputs"])
        x = _x()
        for i, layer in enumerate(model.layers):
            layer.register_forward_pre_hook(lambda _m, args, i=i: link.name(args[0], f"input {i}"))
        model(x).backward()
    assert _moved(link) == ["input 0", "input 1"]


def test_a_measured_step_counts_what_offload_moved_in_host_memory_and_not_on_the_device():
    full, offloaded = Net(), Net()
    sac2.apply_ac(full, "full")
    with stand_in():
        sac2.apply_ac(offloaded, "full", offload=["inputs"])
        moved, _ = measure_step(lambda: offloaded(_x()), "cpu")
        kept, _ = measure_step(lambda: full(_x()), "cpu")
    assert moved.host == 2 * B * T * D * 4  # layers 0 and 1's inputs (float32); the last layer keeps its own
    assert (moved.kept, kept.host) == (kept.kept - moved.host, 0)


def test_an_offloaded_regions_output_and_what_its_body_keeps_move_once_each():
    model = Net(2)
    with stand_in() as link:
        sac2.apply_ac(model, "regions", save=["linear"], offload=["attention"])
        model(_x()).backward()
    # layer 0's attention: its output (served in recompute and kept by SDPA's backward: one copy) and logsumexp
    assert sorted(_moved(link)) == ["float32[2, 2, 8, 8]", "float32[2, 2, 8]"]


def test_apply_ac_offload_composes_with_install():
    base = Net()
    offloaded, saved = copy.deepcopy(base), copy.deepcopy(base)
    with sac2.install(), stand_in() as link:
        sac2.apply_ac(offloaded, "regions", offload=["inputs", "attention"])
        got = _train(offloaded)
    assert _moved(link)
    sac2.apply_ac(saved, "regions")
    assert _same(got, _train(saved))


def test_an_offloaded_checkpoint_input_written_in_place_after_the_call_is_autograds_error():
    model = Net()
    with stand_in():
        sac2.apply_ac(model, "full", offload=["inputs"])
        inputs = []
        model.layers[1].register_forward_pre_hook(lambda _m, args: inputs.append(args[0]))
        loss = model(_x())
        with torch.no_grad():
            inputs[0].add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


def test_an_offloaded_output_written_in_place_after_the_forward_is_autograds_error_as_a_saved_one():
    def block(x):
        y = counted(x.sin())
        return y, y.cos()

    def policy(answer):
        return lambda _ctx, op, *a, **k: answer if op is COUNTED else CheckpointPolicy.PREFER_RECOMPUTE

    for answer in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.MUST_CPU_OFFLOAD):
        with stand_in():
            x = randn(8) * 1.0
            y, z = sac2.checkpoint(block, x, context_fn=contexts(policy(answer)))
            sac2.checkpoint(lambda t: t * 2, z)  # the next block starts: y's copy to the host is queued
            with torch.no_grad():
                y.add_(1)  # before the copy runs
            with pytest.raises(RuntimeError, match="modified by an inplace operation"):
                z.sum().backward()  # the copy to the host read the written value: it must not reach backward


def test_a_nested_checkpoints_inputs_stay_positions_of_the_outer_one():
    policy = SaveList([], offload_inputs=True)

    def inner(x):
        return x.sin().cos()

    def outer(x):
        return sac2.checkpoint(inner, x.exp(), context_fn=contexts(policy)) * 2

    def step(leaf):
        h = sac2.checkpoint(outer, leaf * 1.0, context_fn=contexts(policy))
        sac2.checkpoint(lambda t: t + 1, h, context_fn=contexts(policy)).sum().backward()  # the last block
        return leaf.grad

    with stand_in() as link:
        grad = step(randn(4, 4))
    assert _moved(link) == ["float32[4, 4]"]  # the outer checkpoint's input; not the inner one's
    leaf = randn(4, 4)
    (outer(leaf * 1.0) + 1).sum().backward()
    assert torch.equal(grad, leaf.grad)


def _error(error, **kwargs):
    with stand_in(), pytest.raises(error) as caught:
        sac2.apply_ac(Net(), **kwargs)
    return str(caught.value)


def test_offload_with_mode_none_is_an_error():
    assert_expected_inline(_error(ValueError, mode="none", offload=["inputs"]), """\
sac2.apply_ac: offload=['inputs'] with mode='none', which checkpoints nothing and so saves nothing.""")


def test_an_empty_offload_is_an_error():
    assert_expected_inline(_error(ValueError, offload=[]), """\
sac2.apply_ac: offload= names nothing; name what to keep in host memory ("inputs", "attention", "linear", a module class or name, an op) or leave it out.""")  # noqa: E501


def test_one_name_is_an_error():
    assert_expected_inline(_error(TypeError, offload="inputs"), """\
sac2.apply_ac: offload='inputs' is one name; pass a list of names, e.g. ['inputs'].""")


def test_something_that_is_no_target_is_an_error():
    assert_expected_inline(_error(TypeError, offload=[3]), """\
sac2.apply_ac: offload= holds 3 (int); expected "inputs", a region name ("attention", "linear", "experts", a module name glob), an nn.Module class, or an op overload such as torch.ops.aten.mm.default.""")  # noqa: E501


def test_a_region_name_that_matches_nothing_is_an_error():
    assert "matches no module" in _error(ValueError, mode="regions", offload=["nothing.here"])


def test_an_op_packet_is_an_error():
    assert "aten.mm.default" in _error(ValueError, offload=[aten.mm])


def test_without_an_accelerator_offload_changes_nothing_and_says_so_once(monkeypatch):
    monkeypatch.setattr(offload_targets, "_told", [False])
    base = Net()
    models = [copy.deepcopy(base) for _ in range(3)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sac2.apply_ac(models[0], "full", offload=["inputs", "attention"])
        sac2.apply_ac(models[1], "full", offload=["inputs"])
    assert [str(w.message) for w in caught] == [
        "sac2.apply_ac: offload= changes nothing on this machine: it has no CUDA device, so there is no device "
        "memory to free. The blocks are checkpointed as they would be without offload=."
    ]
    sac2.apply_ac(models[2], "full")
    assert type(models[0].layers[0].attention) is Attention  # no region made
    assert _same(_train(models[0], 1), _train(models[2], 1))


def test_offload_limits_are_checked_and_put_back():
    old = sac2.offload_limits(host_memory=1 << 20, prefetch=0)
    try:
        assert sac2.offload_limits(*old) == (1 << 20, 0)
        with pytest.raises(ValueError, match="host_memory=-1"):
            sac2.offload_limits(host_memory=-1)
        assert schedule.limits() == old
    finally:
        sac2.offload_limits(*old)


def test_a_partial_context_fn_of_an_offloading_policy_pickles():
    import pickle

    policy = SaveList([aten.mm.default], offload=[aten.addmm.default], offload_inputs=True)
    back = pickle.loads(pickle.dumps(functools.partial(sac2.create_selective_checkpoint_contexts, policy)))
    assert repr(back.args[0]) == repr(policy)


def test_under_torch_compile_offload_says_it_keeps_what_it_names_on_the_device():
    policy = SaveList([aten.mm.default], offload=[aten.mm.default], offload_inputs=True)

    def step(x, w):
        return sac2.checkpoint(lambda a, b: (a @ b).sin(), x * 1.0, w, context_fn=contexts(policy)).sum()

    x, w = randn(4, 4), randn(4, 4, seed=1)
    with pytest.warns(UserWarning, match="under torch.compile what a policy offloads stays in device memory"):
        torch.compile(step, backend="aot_eager")(x, w).backward()


def test_on_torchs_frame_offload_keeps_what_it_names_on_the_device_and_says_so(monkeypatch):
    from sac2.core import notices

    monkeypatch.setattr(notices, "_warned", set())
    policy = SaveList([aten.mm.default], offload=[aten.mm.default], offload_inputs=True)

    def block(a, b):
        return (a @ b).sin()

    x, w = randn(4, 4), randn(4, 4, seed=1)
    with stand_in() as link, pytest.warns(UserWarning, match="runs on torch's frame") as caught:
        h = x * 1.0
        for _ in range(3):
            h = torch.utils.checkpoint.checkpoint(block, h, w, use_reentrant=False, context_fn=contexts(policy))
        (got,) = torch.autograd.grad(h.sum(), w)
    assert link.log == [] and len([w for w in caught if "torch's frame" in str(w.message)]) == 1
    h = x * 1.0
    for _ in range(3):
        h = block(h, w)
    assert torch.equal(got, torch.autograd.grad(h.sum(), w)[0])
