"""sac2's eager checkpoint frame: what autograd keeps of a checkpointed call (positions, not tensors), the
recompute on the first unpack of a backward, and the in-place check of the tensors it stands in for. ``entry``
is the door both routes share (``sac2.checkpoint`` and torch's ``checkpoint`` under ``install()``). The frame
imports no mode and no record: a policy's contexts reach it through the ``PolicyContexts`` protocol."""

__all__: list[str] = []
