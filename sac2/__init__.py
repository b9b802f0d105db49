"""sac2: selective activation checkpointing that handles every op, HOP and compiled region, and is faster.

Change ``from torch.utils.checkpoint import ...`` to ``from sac2 import ...``; everything else stays.
"""

from sac2 import policies
from sac2.advice import Advice
from sac2.advisor import advise
from sac2.answers import CheckpointPolicy, SelectiveCheckpointContext
from sac2.apply import apply_ac
from sac2.checkpointing import checkpoint, create_selective_checkpoint_contexts
from sac2.compiled import compiled_region
from sac2.frame_switches import preserve_generators, use_torch_frame
from sac2.integrations import install, installed
from sac2.keys import Region, region_of
from sac2.notices import forward_count
from sac2.profile import activation_memory
from sac2.regions import region
from sac2.report import Report, explain, plot_budgets
from sac2.wrappers import (
    ActivationWrapper,
    CheckpointImpl,
    CheckpointWrapper,
    OffloadWrapper,
    apply_activation_checkpointing,
    checkpoint_module,
    checkpoint_wrapper,
    offload_wrapper,
)

__all__ = [
    "checkpoint",
    "create_selective_checkpoint_contexts",
    "use_torch_frame",
    "preserve_generators",
    "CheckpointPolicy",
    "SelectiveCheckpointContext",
    "Region",
    "region_of",
    "compiled_region",
    "region",
    "policies",
    "apply_ac",
    "advise",
    "Advice",
    "ActivationWrapper",
    "CheckpointImpl",
    "CheckpointWrapper",
    "apply_activation_checkpointing",
    "checkpoint_module",
    "checkpoint_wrapper",
    "offload_wrapper",
    "OffloadWrapper",
    "explain",
    "Report",
    "plot_budgets",
    "activation_memory",
    "forward_count",
    "install",
    "installed",
]

__version__ = "0.4.0"
