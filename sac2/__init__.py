"""sac2: selective activation checkpointing that handles every op, HOP and compiled region, and is faster.

Change ``from torch.utils.checkpoint import ...`` to ``from sac2 import ...``; everything else stays.

The library's names are imported here; the tools' (``advise``, ``Advice``, ``explain``, ``Report``,
``plot_budgets``: ``sac2.advisor``; ``activation_memory``: ``sac2.measure``) on first use, so that ``import sac2``
loads no tool.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from sac2 import messages, policies
from sac2.api import moved
from sac2.api.apply import apply_ac
from sac2.api.checkpointing import checkpoint, create_selective_checkpoint_contexts
from sac2.api.offload_targets import offload_limits
from sac2.api.wrappers import (
    ActivationWrapper,
    CheckpointImpl,
    CheckpointWrapper,
    OffloadWrapper,
    apply_activation_checkpointing,
    checkpoint_module,
    checkpoint_wrapper,
    offload_wrapper,
)
from sac2.core.decisions import CheckpointPolicy, SelectiveCheckpointContext
from sac2.core.keys import Region, region_of
from sac2.core.notices import EagerFallbackWarning, forward_count
from sac2.frame.switches import preserve_generators, use_torch_frame
from sac2.integrations import install, installed
from sac2.modes.compiled import compiled_region
from sac2.regions.calls import region

if TYPE_CHECKING:
    from sac2.advisor import Advice, Report, advise, explain, plot_budgets
    from sac2.measure.kept import activation_memory

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
    "offload_limits",
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
    "EagerFallbackWarning",
    "install",
    "installed",
]

__version__ = "0.5.0"

#: The tools' names: where each lives, imported on first use.
_TOOLS = {
    "advise": "sac2.advisor",
    "Advice": "sac2.advisor",
    "explain": "sac2.advisor",
    "Report": "sac2.advisor",
    "plot_budgets": "sac2.advisor",
    "activation_memory": "sac2.measure.kept",
}

moved.install()


def __getattr__(name: str) -> Any:
    module = _TOOLS.get(name)
    if module is None:
        raise AttributeError(messages.no_attribute(__name__, name))
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # found once: later reads are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
