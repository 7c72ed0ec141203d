"""Stage 1, split: the Dynamo graph cut at splitting ops into compute pieces and opaque calls.

Owns: matching splitting ops (`splitter.SplittingOpMatcher`), splitting the graph and HOP bodies
(`splitter.split_graph`), Python scalars that cross pieces (`scalars.py`), and which graph inputs
are written in place (`graph_writes.py`, read by later stages).
May import: torch_ext.backend.config / counters / dump only.
"""
