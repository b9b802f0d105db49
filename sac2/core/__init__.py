"""What every layer of sac2 shares, and nothing above it: op keys and the op table, what a policy may answer and
the one function that turns an answer into a decision, where an op writes, which generator it draws from, warnings
given once, pickling of ops, module-name matching."""

__all__: list[str] = []
