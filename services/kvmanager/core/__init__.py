"""The kvmanager's transport-free core: block layouts, store config, errors and the tier index
(which block is on which tier, budgets, LRU, pins). No grpc, etcd, vLLM, torch or file I/O here;
``services/kvmanager/store.py`` carries out what the index plans."""
