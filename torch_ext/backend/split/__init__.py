"""Stage 1, split: the Dynamo graph cut at splitting ops into compute pieces and opaque calls.

Owns: matching splitting ops (`matcher.py`), splitting the graph and HOP bodies (`splitter.py`),
activation-checkpoint regions kept as regions (`checkpoint.py`), Python scalars that cross pieces
(`scalars.py`), fake values the partitioner left out (`values.py`), and which graph inputs are written
in place (`graph_writes.py`, read by later stages).
May import: torch_ext.backend.config / counters / dump only.
"""
