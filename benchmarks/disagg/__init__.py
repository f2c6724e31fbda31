"""``kvmesh bench disagg``: prefill/decode disaggregation on the simulator (aggregated, always
and selective side by side) and the hand-off time per block on real vLLM (CPU, tiny model)."""
