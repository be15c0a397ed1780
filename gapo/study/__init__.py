"""The research workflow around runs: experiment manifests and their sweeps (manifest.py, sweep.py, slurm.py), a
run's checkpoints evaluated under a table's protocol (eval.py), runs compared across seeds (compare.py: the paper's
tables in tables.py, seeds per label in seeds.py, clip-rule bands in band.py) and figures (plot.py, figures.py).
A command's module is named for it: gapo-eval is eval.py, gapo-compare compare.py, gapo-plot plot.py, gapo-sweep
sweep.py."""
