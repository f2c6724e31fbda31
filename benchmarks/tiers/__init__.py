"""``kvmesh bench tiers``: what the kvmanager's tiers move, each figure beside this machine's own
limit measured in the same run (memcpy, sequential file I/O, raw loopback TCP, recompute).

Modules: ``report`` (pure: figures, ratios, the table and the JSON rows), ``limits`` (the
machine's limits: memcpy, raw file I/O, page cache eviction), ``daemons`` (kvmanager child
processes), one module per part (``offload``, ``disk``, ``peer``, ``ttft``), ``net`` (the raw TCP
sender) and ``cli``.
"""
