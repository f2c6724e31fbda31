"""Peer fetch: a kvmanager fetches the KV blocks it lacks from another node's kvmanager.

The gRPC control plane (``OpenFetch``) grants a one-time ticket for the leading run of the
asked blocks the holder has; the fetching kvmanager redeems it on the holder's raw-TCP data
plane, which streams the blocks checksummed, flow-controlled, stall and deadline bounded. Each
whole verified block goes into the CPU tier with its parent hash as it arrives; a peer that
dies or stalls mid-stream leaves those blocks (and nothing partial), and the fetch raises
``PeerFetchFailed`` / ``PeerFetchTimedOut`` saying how many were fetched: the caller recomputes
the rest. See docs/kvmanager.md and docs/kvmanager-dataplane.md.

- ``core.py``: pure: tickets (``TicketBook``), the windows of both ends of a stream, how far a
  fetch got (``FetchPlan``, ``FetchProgress``);
- ``wire.py``: pure: the data plane's framing and checksums;
- ``server.py`` / ``client.py``: the data plane's two ends (a thread per stream; ``sockets.py``
  their shared socket helpers);
- ``service.py``: ``PeerService``, both sides for one kvmanager over its store;
  ``directory.py``: peers by kvmanager id (etcd) and their gRPC channels.
"""

from .core import FetchGrant, FetchProgress, PeerRef
from .directory import PeerDirectory
from .server import BlockSource, DataPlaneConfig, DataPlaneServer, DataPlaneStats
from .service import PeerService, PeerStats, StoreBlockSource

__all__ = [
    "BlockSource",
    "DataPlaneConfig",
    "DataPlaneServer",
    "DataPlaneStats",
    "FetchGrant",
    "FetchProgress",
    "PeerDirectory",
    "PeerRef",
    "PeerService",
    "PeerStats",
    "StoreBlockSource",
]
