"""Measuring, shared by the tools (``sac2 bench``, ``sac2.advise``, the benchmarks): one training step timed or its
memory measured, gradients compared with a reference, the order side-by-side runs take turns in, the Pareto front,
deterministic kernels on CUDA, the bytes a call keeps (``sac2.activation_memory``), and the command-line argument
types both command lines use. A tool layer: the library never imports it."""

__all__: list[str] = []
