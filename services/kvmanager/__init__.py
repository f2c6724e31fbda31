"""The KV-cache manager: a daemon per node owning the KV tiers below the engine's GPU memory (CPU
DRAM, then disk). ``core/`` is pure bookkeeping (layouts, tiers, eviction); ``store.py`` and
``diskfile.py`` are the adapters that hold the bytes in RAM and files; ``peer/`` fetches blocks
from other nodes' kvmanagers (a pure core, the data plane's wire format, its client and server);
``servicer.py`` and ``main.py`` are the gRPC and process edges. See docs/kvmanager.md.
"""
