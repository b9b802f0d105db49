"""Offload: saved tensors in pinned host memory between forward and backward, their copies hidden behind compute.

``link``: the accelerator, its streams and its host link as offload uses them (CUDA's, or ``standin``'s CPU
stand-in, which runs and checks the whole schedule on any machine). ``pool``: pinned host buffers reused step after
step, within a cap. ``parcel``: one tensor's way to the host and back. ``schedule``: the blocks (one per checkpointed
forward) and when their copies start: to the host when the next block's forward starts (the last block's stay on
the device), back while the block backward reaches before it runs, within a device-memory allowance.
``saves``: saved-tensor hooks that put a tensor on that way (a checkpoint's inputs, a saved region's backward
state). The frame, the record and the regions ask for it; this package imports none of them.
"""

__all__: list[str] = []
