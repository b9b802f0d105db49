"""The record one checkpointed forward leaves for its recompute: one entry per op or region call in call order, the
saved entries (``Saved``) and their lifecycle, what a saved region's body saves and shares. The
modes and the dispatch-free region contexts fill it in forward and serve from it in recompute."""

__all__: list[str] = []
