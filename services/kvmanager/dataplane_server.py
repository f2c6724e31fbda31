"""Where ``main.py`` still imports the data plane server from; it lives in ``peer/server.py``.
Goes once ``main.py`` imports ``from .peer`` (its rewrite onto the one service host, issue 13
part 1, owns that file)."""

from .peer.server import BlockSource, DataPlaneConfig, DataPlaneServer

__all__ = ["BlockSource", "DataPlaneConfig", "DataPlaneServer"]
