"""The pair of contexts a selective policy runs under: sac2's dispatch modes (``CachingMode`` in forward,
``ReplayMode`` in recompute), the dispatch-free pair for region-only policies, the mode that tags nodes while
torch.compile traces a checkpoint, ``compiled_region()`` and torch's dispatch-mode flags across threads."""

__all__: list[str] = []
