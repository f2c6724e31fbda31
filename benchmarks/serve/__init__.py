"""``kvmesh bench serve``: kvmesh against plain ``vllm serve`` under vLLM's own load client."""
