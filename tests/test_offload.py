"""CPU_OFFLOAD policies: on CPU tensors they save (nothing to offload to); CUDA is in benchmarks/gpu_offload.py."""

import torch
from expecttest import TestCase

import sac2
from sac2.answers import CheckpointPolicy

_runs = {"n": 0}


@torch.library.custom_op("sac2_test_offload::scale", mutates_args=())
def scale(x: torch.Tensor) -> torch.Tensor:
    _runs["n"] += 1
    return x * 3


scale.register_autograd(lambda ctx, g: g * 3)


def _f(x):
    return scale(x.sin()).cos()


def _offload_scale(policy):
    def fn(ctx, op, *args, **kwargs):
        return policy if op is torch.ops.sac2_test_offload.scale.default else CheckpointPolicy.PREFER_RECOMPUTE

    return fn


def _run(policy):
    x = torch.randn(8, requires_grad=True, generator=torch.Generator().manual_seed(0))
    _runs["n"] = 0
    out = sac2.checkpoint(_f, x, context_fn=lambda: sac2.create_selective_checkpoint_contexts(policy))
    (grad,) = torch.autograd.grad(out.sum(), x)
    return grad, _runs["n"]


class TestCpuOffloadOnCpu(TestCase):
    def test_must_cpu_offload_saves_the_output(self):
        grad, runs = _run(_offload_scale(CheckpointPolicy.MUST_CPU_OFFLOAD))
        self.assertEqual(runs, 1)  # forward only: backward served the kept output

    def test_prefer_cpu_offload_saves_the_output(self):
        grad, runs = _run(_offload_scale(CheckpointPolicy.PREFER_CPU_OFFLOAD))
        self.assertEqual(runs, 1)

    def test_gradients_match_no_checkpoint_bit_for_bit(self):
        grad, _ = _run(_offload_scale(CheckpointPolicy.MUST_CPU_OFFLOAD))
        x = torch.randn(8, requires_grad=True, generator=torch.Generator().manual_seed(0))
        (want,) = torch.autograd.grad(_f(x).sum(), x)
        self.assertTrue(torch.equal(grad, want))

    def test_a_cpu_entry_stays_an_ordinary_save(self):
        mode, _ = sac2.create_selective_checkpoint_contexts(_offload_scale(CheckpointPolicy.MUST_CPU_OFFLOAD))
        with mode:
            _f(torch.randn(8))
        (entry,) = [mode.record.log[i] for i in mode.record.saved_at]
        self.assertIsNone(entry.offload)
        self.assertEqual(len(entry.tensors), 1)
