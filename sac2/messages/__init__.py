"""Every text sac2 shows its user: the messages of the exceptions it raises and of the warnings it gives.

One function or constant per message, each building the exact text the tests pin, in a submodule per kind:
``recompute`` (divergence, saved values sac2 recomputes instead), ``policies``, ``checkpoint_frame`` (the
checkpoint's arguments, the frame, autograd's errors, internal errors), ``wrapping`` (wrappers, ``apply_ac``,
regions, integrations, the bench), ``offload`` and ``advisor``. This package re-exports every one, so callers write
``messages.X`` whichever submodule builds it. Callers pass what the text names (op names as ``op_name`` renders
them, positions as ``Record.describe`` renders them); the package computes nothing else and imports nothing from
sac2 outside itself, so every module, ``_compat`` included, can use it. Texts that reproduce torch's own wording
(its ``CheckpointError``s, ``Expected op in op_list...``) say so: code may match them. Whether a warning is given
once is ``sac2.core.notices``' business; the bench's command-line errors belong to ``sac2.bench.cli``.
"""

# Each submodule's ``__all__`` is the one list of its names; this package re-exports them all.
from sac2.messages import advisor, checkpoint_frame, offload, policies, recompute, wrapping
from sac2.messages.advisor import *  # noqa: F403
from sac2.messages.checkpoint_frame import *  # noqa: F403
from sac2.messages.offload import *  # noqa: F403
from sac2.messages.policies import *  # noqa: F403
from sac2.messages.recompute import *  # noqa: F403
from sac2.messages.wrapping import *  # noqa: F403

__all__ = (
    recompute.__all__ + policies.__all__ + checkpoint_frame.__all__ + wrapping.__all__ + advisor.__all__
    + offload.__all__
)
