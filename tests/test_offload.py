"""CPU_OFFLOAD policies: on CPU tensors they save (nothing to offload to); CUDA is in benchmarks/gpu_offload.py."""

import weakref

import torch
from expecttest import TestCase

import sac2
from sac2._compat import tree_map
from sac2.core.decisions import CheckpointPolicy
from sac2.measure.memory import Memory, measure_step

from helpers import COUNTED, contexts, counted_op, randn

counted, counted_runs = counted_op("test_offload")


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


class TestCpuOffloadOnCpu(TestCase):
    def test_must_cpu_offload_saves_the_output(self):
        grad, runs = _run(_offload_counted(CheckpointPolicy.MUST_CPU_OFFLOAD))
        self.assertEqual(runs, 1)  # forward only: backward served the kept output

    def test_prefer_cpu_offload_saves_the_output(self):
        grad, runs = _run(_offload_counted(CheckpointPolicy.PREFER_CPU_OFFLOAD))
        self.assertEqual(runs, 1)

    def test_gradients_match_no_checkpoint_bit_for_bit(self):
        grad, _ = _run(_offload_counted(CheckpointPolicy.MUST_CPU_OFFLOAD))
        x = randn(8)
        (want,) = torch.autograd.grad(_f(x).sum(), x)
        self.assertTrue(torch.equal(grad, want))

    def test_a_cpu_entry_keeps_the_one_output_it_saves(self):
        x = randn(1024)
        kept = sac2.activation_memory(_f, (x,), _offload_counted(CheckpointPolicy.MUST_CPU_OFFLOAD))
        self.assertEqual(kept, x.nbytes)  # counted's output, and nothing else

    def test_a_cpu_entry_costs_what_an_ordinary_save_costs_and_copies_nothing(self):
        offloaded = _step_memory(CheckpointPolicy.MUST_CPU_OFFLOAD)
        saved = _step_memory(CheckpointPolicy.MUST_SAVE)
        recomputed = _step_memory(CheckpointPolicy.PREFER_RECOMPUTE)
        self.assertEqual(offloaded, saved)  # kept and peak: no host copy was made or kept
        self.assertEqual(offloaded.kept - recomputed.kept, 1024 * 4)


class _HostLink:
    """A stand-in for the CUDA host link, so the offload lifecycle runs on CPU: ``sac2.record.offload``'s four functions
    replaced by plain copies; every "host" copy is watched through a weak reference."""

    def __init__(self, monkeypatch) -> None:
        from sac2.record import offload

        self.copies: list[weakref.ref] = []

        def host(x):
            if not isinstance(x, torch.Tensor):
                return x
            copy = x.detach().clone()
            self.copies.append(weakref.ref(copy))
            return offload._Host(copy)

        def to_host(out, written, device):
            return offload.Offloaded(tree_map(host, out), tuple((p, host(t)) for p, t in written), device)

        def to_device(off):
            def back(x):
                return x.tensor.clone() if type(x) is offload._Host else x

            off.event = object()
            written = tuple((p, back(t)) for p, t in off.host_writes)
            return tree_map(back, off.host_out, is_leaf=offload._is_host), written

        monkeypatch.setattr(offload, "cuda_device", lambda _tensors: torch.device("cpu"))
        monkeypatch.setattr(offload, "to_host", to_host)
        monkeypatch.setattr(offload, "to_device", to_device)
        monkeypatch.setattr(offload, "wait", lambda _off, _out, _written: None)

    def alive(self) -> int:
        return sum(ref() is not None for ref in self.copies)


def test_what_offload_moved_to_the_host_is_freed_once_backward_has_used_it(monkeypatch):
    link = _HostLink(monkeypatch)
    x = randn(8)
    before = counted_runs()
    h = x
    for _ in range(3):  # three checkpoints in a chain, each offloading counted's output
        h = sac2.checkpoint(_f, h, context_fn=contexts(_offload_counted(CheckpointPolicy.MUST_CPU_OFFLOAD)))
    copies = link.alive()
    (grad,) = torch.autograd.grad(h.sum(), x)
    del h
    want = x
    for _ in range(3):
        want = _f(want)
    (want_grad,) = torch.autograd.grad(want.sum(), x)
    assert (copies, counted_runs() - before) == (3, 3 + 3)  # one host copy each; counted ran in forward only
    assert torch.equal(grad, want_grad)
    assert link.alive() == 0  # held past backward, a copy kept its recompute's graph and the frame alive for good


def test_a_region_output_offloaded_to_the_host_is_not_kept_on_the_device_by_the_next_region(monkeypatch):
    from sac2.record import region_saves

    _HostLink(monkeypatch)
    a, b = torch.nn.Linear(16, 16), torch.nn.Linear(16, 16)

    def body(x):
        return sac2.region(b, name="off_b")(sac2.region(a, name="off_a")(x))

    def policy(_ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_CPU_OFFLOAD if op == sac2.Region("off_a") else CheckpointPolicy.MUST_SAVE

    def kept() -> int:
        step = lambda: sac2.checkpoint(body, x, use_reentrant=False, context_fn=contexts(policy)).sum()  # noqa: E731
        return measure_step(step, "cpu")[0].kept

    x = randn(4096, 16)
    offloaded = kept()
    try:
        region_saves.keep_inputs(["off_b"], True)  # off_b keeps off_a's output on the device itself
        keeping = kept()
    finally:
        region_saves.keep_inputs(["off_b"], False)
    assert keeping - offloaded >= 4096 * 16 * 4
