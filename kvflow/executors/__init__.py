"""How a step runs, per device and mode: the plan (plan.py), the executors (layers.py, cpu_fast.py,
cuda.py) and the one table of row-count crossovers (thresholds.py). model_setup.py loads a model for its
plan and builds an engine's executor."""
