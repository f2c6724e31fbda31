"""A router and a worker in one process (``kvmesh node``): the single-node mesh without a hop."""
