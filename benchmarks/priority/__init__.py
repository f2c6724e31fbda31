"""The priority mix: kvmesh bench priority (cli.py), its workload and report (workload.py)."""
