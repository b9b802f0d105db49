"""sac2: selective activation checkpointing that handles every op, HOP and compiled region, and is faster.

Change ``from torch.utils.checkpoint import ...`` to ``from sac2 import ...``; everything else stays.
"""

from sac2.checkpoint import checkpoint, create_selective_checkpoint_contexts
from sac2.hops import Region, region_of
from sac2.policy import CheckpointPolicy, SelectiveCheckpointContext

__all__ = [
    "checkpoint",
    "create_selective_checkpoint_contexts",
    "CheckpointPolicy",
    "SelectiveCheckpointContext",
    "Region",
    "region_of",
]

__version__ = "0.1.0"
