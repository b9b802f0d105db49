"""CPU_OFFLOAD policies: on CPU tensors they save (nothing to offload to); CUDA is in benchmarks/gpu_offload.py."""

import torch
from expecttest import TestCase

import sac2
from sac2.answers import CheckpointPolicy
from sac2.bench.memory import Memory, measure_step

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
