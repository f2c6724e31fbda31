"""The KV-cache manager: a daemon per node owning the KV tiers below the engine's GPU memory (CPU
DRAM, then disk). ``core/`` is pure bookkeeping (layouts, tiers, eviction); ``store.py`` and
``diskfile.py`` are the adapters that hold the bytes in RAM and files; ``peer.py`` and the
``dataplane_*`` modules fetch blocks from other nodes' kvmanagers; ``servicer.py`` and ``main.py``
are the gRPC and process edges. See docs/kvmanager.md.
"""
