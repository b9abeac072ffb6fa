"""Tensor parallelism: one model across the devices of a worker (group.py: the rank and its
collectives; workers.py: the rank processes; models/sharding.py: what each rank holds)."""
