"""KV-cache vocabulary shared by router, workers and (later) kvmanagers: block hashes computed
exactly as vLLM does (``hashing``) and the block events engines publish (``events``). Pure."""
