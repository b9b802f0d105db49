"""WHITE-BOX tests of the record (``sac2.record.record``): they read its internals on purpose and are the only tests
that may.

Every behaviour checked here is also checked from outside (what runs again in backward, bytes kept, gradients)
in the behavioural test files; these few pin the record's shape so a refactor of it sees at once what it changed.
Rewrite them freely when the record changes: keep them few, and keep them here.
"""

import pytest
import torch

import sac2
from sac2.core.decisions import CheckpointPolicy
from sac2.messages.internal import InternalError
from sac2.modes.forward import CachingMode
from sac2.record.saved import Saved, State

from helpers import COUNTED, counted_op, grads, inplace_chain, randn

aten = torch.ops.aten
counted, _ = counted_op("test_record_whitebox")


def _saved_keys(caching) -> list:
    return [e.key for e in caching.record.log if type(e) is Saved]


def test_saved_ops_are_saved_entries_in_call_order_and_the_rest_keys():
    caching, replay = sac2.create_selective_checkpoint_contexts([aten.add_.Tensor, aten.mul_.Tensor])
    sac2.checkpoint(inplace_chain, randn(32), context_fn=lambda: (caching, replay))
    assert _saved_keys(caching) == [aten.add_.Tensor, aten.mul_.Tensor]
    assert [e for e in caching.record.log if type(e) is not Saved] == [
        aten.mul.Tensor, aten.sin.default, aten.exp.default
    ]


def test_the_last_backward_leaves_only_keys_in_the_record():
    caching, replay = sac2.create_selective_checkpoint_contexts([aten.add_.Tensor, aten.mul_.Tensor])
    x = randn(32)
    out = sac2.checkpoint(inplace_chain, x, context_fn=lambda: (caching, replay))
    grads(out, (x,))
    assert _saved_keys(caching) == []  # backward released what it served


def test_a_cpu_offload_entry_on_cpu_tensors_is_an_ordinary_saved_entry():
    def policy(_ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_CPU_OFFLOAD if op is COUNTED else CheckpointPolicy.PREFER_RECOMPUTE

    mode, _ = sac2.create_selective_checkpoint_contexts(policy)
    with mode:
        counted(torch.randn(8).sin()).cos()
    (entry,) = [mode.record.log[i] for i in mode.record.saved_at]
    assert isinstance(entry, Saved)
    assert entry.state is State.HELD  # not ON_HOST: nothing on a device to offload
    assert len(entry.tensors) == 1


def test_a_step_outside_a_saved_entrys_lifecycle_is_an_internal_error():
    # No public behaviour takes such a step (that would be the bug this guards against), so only here: an entry
    # the user's hooks hold cannot go stale, nor one never answered CPU_OFFLOAD go to the host.
    entry = Saved(aten.sin.default)
    entry.keep_output(torch.randn(3))
    entry.pack((lambda t: t, lambda t: t))
    with pytest.raises(InternalError, match="in state PACKED was moved to STALE"):
        entry.mark_stale()
    with pytest.raises(InternalError, match="in state HELD was moved to ON_HOST"):
        Saved(aten.sin.default).to_host()


def test_a_compiled_region_body_leaves_no_entry():
    def fn(x):
        y = x.sin()
        with sac2.compiled_region():
            y = y.cos().exp().tanh()
        return y.sum()

    caching, replay = sac2.create_selective_checkpoint_contexts([])
    sac2.checkpoint(fn, randn(5), context_fn=lambda: (caching, replay))
    assert [str(op) for op in caching.record.log] == ["aten.sin.default", "aten.sum.default"]



def test_a_keyed_op_met_while_tracing_is_recorded_and_replayed_under_its_replay_key():
    # As torch.compile traces a checkpointed region (a proxy mode, ac_graph_id set by torch's checkpoint HOP): a
    # compiled callable is keyed by the callable in the record and in recompute alike, so recompute is served
    # instead of reporting a divergence.
    from torch._higher_order_ops.wrap import InductorCompiledCallable, inductor_compiled_code
    from torch.fx.experimental.proxy_tensor import make_fx

    from sac2.core.keys import replay_key

    graph = torch.fx.symbolic_trace(lambda a: [a.sin()])
    compiled = InductorCompiledCallable(lambda inputs: [inputs[0].sin()], graph, compile_region_name="attn")
    forward, recompute = sac2.create_selective_checkpoint_contexts(lambda _ctx, _op, *args, **kwargs: False)
    assert isinstance(forward, CachingMode)
    forward.ac_graph_id = 0
    keys = []

    def traced(x):
        with forward:
            (y,) = inductor_compiled_code(compiled, [x])
        keys.append(replay_key(inductor_compiled_code, (compiled, [x])))
        with recompute:
            (z,) = inductor_compiled_code(compiled, [x])
        return y + z

    make_fx(traced)(torch.randn(4))
    saved = forward.record.log
    assert all(isinstance(e, Saved) for e in saved)
    assert [e.key for e in saved if isinstance(e, Saved)] == keys
