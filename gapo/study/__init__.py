"""The research workflow around runs: experiment manifests and their sweeps (sweep.py), a run's checkpoints
evaluated under a table's protocol (evaluate.py, ifeval.py), seeds aggregated into the paper's tables
(compare.py) and figures (plot.py, figures.py)."""
