"""``sac2.forward_count()``: a counter users read to check that sac2, not torch's SAC, checkpoints their model."""

from functools import partial

import torch
import torch.utils.checkpoint as tuc

import sac2


def _x() -> torch.Tensor:
    return torch.randn(4, requires_grad=True)


def test_counts_selective_full_and_region_only_forwards():
    before = sac2.forward_count()
    sac2.checkpoint(torch.sin, _x(), context_fn=partial(sac2.create_selective_checkpoint_contexts, []))
    sac2.checkpoint(torch.sin, _x())
    sac2.checkpoint(torch.sin, _x(), context_fn=partial(sac2.create_selective_checkpoint_contexts, [sac2.Region("r")]))
    assert sac2.forward_count() - before == 3


def test_torch_sac_is_not_counted():
    before = sac2.forward_count()
    context_fn = partial(tuc.create_selective_checkpoint_contexts, [])
    tuc.checkpoint(torch.sin, _x(), use_reentrant=False, context_fn=context_fn)
    tuc.checkpoint(torch.sin, _x(), use_reentrant=False)
    assert sac2.forward_count() == before
