"""WHITE-BOX tests of the record (``sac2.record``): they read its internals on purpose and are the only tests that may.

Every behaviour checked here is also checked from outside (what runs again in backward, bytes kept, gradients)
in the behavioural test files; these few pin the record's shape so a refactor of it sees at once what it changed.
Rewrite them freely when the record changes: keep them few, and keep them here.
"""

import torch

import sac2
from sac2.answers import CheckpointPolicy
from sac2.record import Saved

from helpers import COUNTED, counted_op, grads, randn

aten = torch.ops.aten
counted, _ = counted_op("test_record_whitebox")


def _inplace_chain(x):
    a = x * 2
    a.add_(1)
    b = a.sin()
    b.mul_(3)
    return b.exp()


def _saved_keys(caching) -> list:
    return [e.key for e in caching.record.log if type(e) is Saved]


def test_saved_ops_are_saved_entries_in_call_order_and_the_rest_keys():
    caching, replay = sac2.create_selective_checkpoint_contexts([aten.add_.Tensor, aten.mul_.Tensor])
    sac2.checkpoint(_inplace_chain, randn(32), context_fn=lambda: (caching, replay))
    assert _saved_keys(caching) == [aten.add_.Tensor, aten.mul_.Tensor]
    assert [e for e in caching.record.log if type(e) is not Saved] == [
        aten.mul.Tensor, aten.sin.default, aten.exp.default
    ]


def test_the_last_backward_leaves_only_keys_in_the_record():
    caching, replay = sac2.create_selective_checkpoint_contexts([aten.add_.Tensor, aten.mul_.Tensor])
    x = randn(32)
    out = sac2.checkpoint(_inplace_chain, x, context_fn=lambda: (caching, replay))
    grads(out, (x,))
    assert _saved_keys(caching) == []  # backward released what it served


def test_a_cpu_offload_entry_on_cpu_tensors_is_an_ordinary_saved_entry():
    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_CPU_OFFLOAD if op is COUNTED else CheckpointPolicy.PREFER_RECOMPUTE

    mode, _ = sac2.create_selective_checkpoint_contexts(policy)
    with mode:
        counted(torch.randn(8).sin()).cos()
    (entry,) = [mode.record.log[i] for i in mode.record.saved_at]
    assert entry.offload is None
    assert len(entry.tensors) == 1


def test_a_compiled_region_body_leaves_no_entry():
    def fn(x):
        y = x.sin()
        with sac2.compiled_region():
            y = y.cos().exp().tanh()
        return y.sum()

    caching, replay = sac2.create_selective_checkpoint_contexts([])
    sac2.checkpoint(fn, randn(5), context_fn=lambda: (caching, replay))
    assert [str(op) for op in caching.record.log] == ["aten.sin.default", "aten.sum.default"]

