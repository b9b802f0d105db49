"""``sac2.forward_count()``: a counter users read to check that sac2, not torch's SAC, checkpoints their model."""

from functools import partial

import torch
import torch.utils.checkpoint as tuc

import sac2

from helpers import randn


def test_counts_selective_full_and_region_only_forwards():
    before = sac2.forward_count()
    sac2.checkpoint(torch.sin, randn(4), context_fn=partial(sac2.create_selective_checkpoint_contexts, []))
    sac2.checkpoint(torch.sin, randn(4))
    context_fn = partial(sac2.create_selective_checkpoint_contexts, [sac2.Region("r")])
    sac2.checkpoint(torch.sin, randn(4), context_fn=context_fn)
    assert sac2.forward_count() - before == 3


def test_torch_sac_is_not_counted():
    before = sac2.forward_count()
    context_fn = partial(tuc.create_selective_checkpoint_contexts, [])
    tuc.checkpoint(torch.sin, randn(4), use_reentrant=False, context_fn=context_fn)
    tuc.checkpoint(torch.sin, randn(4), use_reentrant=False)
    assert sac2.forward_count() == before


def test_full_ac_counts_only_on_sac2s_frame():
    before = sac2.forward_count()
    sac2.checkpoint(torch.sin, randn(4), use_reentrant=True)  # torch's reentrant frame
    with sac2.use_torch_frame():
        sac2.checkpoint(torch.sin, randn(4))
    with torch.no_grad():
        sac2.checkpoint(torch.sin, randn(4))  # nothing is checkpointed
    assert sac2.forward_count() == before
    with sac2.install():
        tuc.checkpoint(torch.sin, randn(4), use_reentrant=False)
    assert sac2.forward_count() - before == 1
