"""What the strategies are built from: the reducer, comm hooks, compression, transfers, process groups, launching.

`strategies/` lists the algorithms; this package holds the mechanisms they share, one concept a module.
"""
