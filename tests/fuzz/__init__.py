"""A differential fuzzer for sac2: random programs, run with no checkpoint, with sac2, with stock SAC and with
torch's plain checkpoint, compared bitwise. ``python -m tests.fuzz --help`` runs it at length."""
