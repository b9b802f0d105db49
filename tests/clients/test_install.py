"""``sac2.integrations.install()`` on plain torch code (no client needed): what it rebinds and what it restores."""

from __future__ import annotations

import functools
import sys
import types

import pytest
import torch
import torch.utils.checkpoint as tuc

import sac2
from sac2.integrations import install, installed

# Held in a tuple: install() rebinds every module-level name that is torch's function, this module's included.
TORCH = types.SimpleNamespace(checkpoint=tuc.checkpoint, contexts=tuc.create_selective_checkpoint_contexts)


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


def test_install_rebinds_names_a_module_bound_at_import_and_uninstall_restores_them(client):
    with install() as handle:
        assert client.ckpt is not TORCH.checkpoint
        assert {"fake_client.ckpt", "fake_client.create_selective_checkpoint_contexts"} <= set(handle.rebound)
    assert client.ckpt is TORCH.checkpoint
    assert client.create_selective_checkpoint_contexts is TORCH.contexts
    assert tuc.checkpoint is TORCH.checkpoint


def test_module_imported_while_installed_gets_torch_functions_back_on_uninstall():
    with install():
        module = types.ModuleType("late_client")
        exec("from torch.utils.checkpoint import checkpoint", module.__dict__)
        sys.modules["late_client"] = module
        assert installed()["late_client.checkpoint"] == "sac2"
    try:
        assert module.checkpoint is TORCH.checkpoint
    finally:
        del sys.modules["late_client"]


def test_nested_installs_restore_torch_when_the_last_one_ends():
    outer = install()
    with install():
        pass
    assert tuc.checkpoint is not TORCH.checkpoint
    outer.uninstall()
    assert tuc.checkpoint is TORCH.checkpoint


def test_verify_raises_naming_a_binding_that_points_at_torch(client):
    with install() as handle:
        client.ckpt = TORCH.checkpoint
        with pytest.raises(RuntimeError, match="fake_client.ckpt"):
            handle.verify()


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
    import torch.distributed.algorithms._checkpoint.checkpoint_wrapper as tcw

    torch_wrapper = (tcw.checkpoint_wrapper,)
    with install():
        wrapped = tcw.checkpoint_wrapper(_block(), context_fn=client.context_fn(sac2.policies.llm()))
    assert isinstance(wrapped, sac2.CheckpointWrapper)
    assert tcw.checkpoint_wrapper is torch_wrapper[0]
    before = sac2.forward_count()
    wrapped(torch.randn(2, 8, requires_grad=True)).sum().backward()
    assert sac2.forward_count() - before == 1
