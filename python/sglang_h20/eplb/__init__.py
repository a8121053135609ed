"""Expert-affinity EPLB: co-activation statistics, affinity-aware placement, simulation, migration.

Data flow: routed expert ids -> stats.CoactivationStats (load + E x E co-activation per layer)
-> placement.place(...) -> placement.Placement (physical slot -> logical expert per layer)
-> simulate.py measures balancedness, cross-node traffic and migration bytes of placements.
"""
