"""`dspark plan`: what a training run will cost before the GPUs are rented.

shapes.py   the target's and drafter's sizes (config.json, or the built-in table offline)
flops.py    FLOPs of one micro-batch, term by term (checked against FlopCounterMode in the tests)
memory.py   per-rank peak memory: states, frozen tables, traced activations, transients
report.py   the plan for a config, a cluster and a data set: fits or not, and what to change
"""
