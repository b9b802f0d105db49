"""The seam matrix: every entry point (route) x execution (eager, compiled) x policy kind x backward style.

Features hold alone and break where two meet. ``matrix.py`` builds the cells from the dimensions and the one table
of rules; ``harness.py`` runs a cell and compares its loss and every gradient with no checkpointing; ``test_seams.py``
runs the pairwise covering design by default and the full product under ``SAC2_SEAMS=full`` (``.ci/seams.sh``).
"""
