"""``sac2.install()`` on plain torch code (no client needed): torch's checkpoint API stays torch's, sac2 runs
under it."""

from __future__ import annotations

import functools
import inspect
import sys
import types
import warnings

import pytest
import torch
import torch.utils.checkpoint as tuc
from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as tcw

import sac2
from sac2.integrations import install, installed

# Held in a namespace: install() rebinds every module-level name that is one of torch's functions, this module's too.
TORCH = types.SimpleNamespace(
    checkpoint=tuc.checkpoint, contexts=tuc.create_selective_checkpoint_contexts, wrapper=tcw.checkpoint_wrapper
)


@pytest.fixture
def client():
    """A module that bound torch's functions at import time, under its own names."""
    module = types.ModuleType("fake_client")
    exec(
        "from torch.utils.checkpoint import checkpoint as ckpt, create_selective_checkpoint_contexts\n"
        "def context_fn(policy):\n"
        "    return lambda: create_selective_checkpoint_contexts(policy)\n",
        module.__dict__,
    )
    sys.modules["fake_client"] = module
    yield module
    del sys.modules["fake_client"]


def _block():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU(), torch.nn.Linear(8, 8))


def _grads(run):
    block = _block()
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    run(block, x).sum().backward()
    return [x.grad, *(p.grad for p in block.parameters())]


def _equal(a, b):
    return len(a) == len(b) and all(torch.equal(p, q) for p, q in zip(a, b, strict=True))


def test_torchs_checkpoint_function_keeps_its_identity_and_signature():
    signature = inspect.signature(TORCH.checkpoint)
    with install():
        assert tuc.checkpoint is TORCH.checkpoint  # dynamo recognises it by identity
        assert inspect.signature(tuc.checkpoint) == signature


def test_install_rebinds_the_contexts_a_module_bound_at_import_and_uninstall_restores_them(client):
    with install() as handle:
        assert client.create_selective_checkpoint_contexts is not TORCH.contexts
        assert "fake_client.create_selective_checkpoint_contexts" in handle.rebound
        assert client.ckpt is TORCH.checkpoint
    assert client.create_selective_checkpoint_contexts is TORCH.contexts
    assert tuc.create_selective_checkpoint_contexts is TORCH.contexts


def test_module_imported_while_installed_gets_torch_functions_back_on_uninstall():
    with install():
        module = types.ModuleType("late_client")
        exec("from torch.utils.checkpoint import create_selective_checkpoint_contexts", module.__dict__)
        sys.modules["late_client"] = module
        assert installed()["late_client.create_selective_checkpoint_contexts"] == "sac2"
    try:
        assert module.create_selective_checkpoint_contexts is TORCH.contexts
    finally:
        del sys.modules["late_client"]


def test_nested_installs_restore_torch_when_the_last_one_ends():
    outer = install()
    with install():
        pass
    assert installed()["torch.utils.checkpoint.create_selective_checkpoint_contexts"] == "sac2"
    outer.uninstall()
    assert set(installed().values()) == {"torch"}


def test_verify_raises_naming_a_binding_that_points_at_torch(client):
    with install() as handle:
        client.create_selective_checkpoint_contexts = TORCH.contexts
        with pytest.raises(RuntimeError, match="fake_client.create_selective_checkpoint_contexts"):
            handle.verify()


def test_torchs_full_checkpoint_under_install_runs_sac2s_frame_with_torchs_gradients():
    expected = _grads(lambda block, x: TORCH.checkpoint(block, x, use_reentrant=False))
    with install():
        before = sac2.forward_count()
        got = _grads(lambda block, x: tuc.checkpoint(block, x, use_reentrant=False))
        assert sac2.forward_count() - before == 1
    assert _equal(got, expected)


def test_torchs_defaults_stay_torchs_under_install():
    """``use_reentrant`` left out: torch's own warning and default, installed or not."""
    def caught():
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            tuc.checkpoint(_block(), torch.randn(2, 8, requires_grad=True)).sum().backward()
        return [str(w.message) for w in seen if "use_reentrant" in str(w.message)]

    expected = caught()
    with install():
        assert caught() == expected


def test_torch_checkpoint_call_under_install_runs_sac2_modes_also_when_nested():
    block = _block()
    x = torch.randn(2, 8, requires_grad=True)
    policy = sac2.policies.llm()

    def outer(x):
        inner = tuc.checkpoint(block, x, use_reentrant=False, context_fn=functools.partial(TORCH.contexts, policy))
        return block(inner)

    with install():
        before = sac2.forward_count()
        context_fn = functools.partial(TORCH.contexts, policy)  # torch's function: redirected to sac2's
        tuc.checkpoint(outer, x, use_reentrant=False, context_fn=context_fn).sum().backward()
        assert sac2.forward_count() - before >= 2


def test_lambda_context_fn_wrapped_while_installed_keeps_sac2_after_uninstall(client):
    """torchtitan's pattern: ``lambda: create_selective_checkpoint_contexts(policy)`` looked up per forward."""
    with install():
        wrapped = tcw.checkpoint_wrapper(_block(), context_fn=client.context_fn(sac2.policies.llm()))
    assert isinstance(wrapped, sac2.CheckpointWrapper)
    assert tcw.checkpoint_wrapper is TORCH.wrapper
    before = sac2.forward_count()
    wrapped(torch.randn(2, 8, requires_grad=True)).sum().backward()
    assert sac2.forward_count() - before == 1


def _compiled_grads(route, policy):
    block = _block()
    x = torch.randn(2, 8, generator=torch.Generator().manual_seed(1), requires_grad=True)
    if route == "function":
        def run(x):
            return tuc.checkpoint(block, x, use_reentrant=False, context_fn=policy)
    else:
        run = tcw.CheckpointWrapper(block, context_fn=policy)  # torch's class, built directly
    torch._dynamo.reset()
    torch.compile(run, backend="aot_eager", fullgraph=True)(x).sum().backward()
    return [x.grad, *(p.grad for p in block.parameters())]


@pytest.mark.parametrize("route", ["function", "torch's CheckpointWrapper"])
def test_fullgraph_compile_of_torchs_checkpoint_under_install_matches_eager(route):
    """dynamo turns torch's checkpoint into its HOP while sac2 is installed, whether called by name or by torch's
    own ``CheckpointWrapper`` (which calls the function it imported)."""
    policy = functools.partial(sac2.create_selective_checkpoint_contexts, sac2.policies.llm())
    expected = _grads(lambda block, x: TORCH.checkpoint(block, x, use_reentrant=False))
    with install():
        got = _compiled_grads(route, policy)
    assert all(torch.allclose(p, q) for p, q in zip(got, expected, strict=True))
