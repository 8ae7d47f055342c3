"""Trace capture and weight following: the serving loop's two background companions.

`TraceWriter` gets every served turn into `liveloop:turns` without touching the response
path (spooling to disk while Redis is away); `WeightFollower` follows the weight transport's
announcements (`liveloop.weights`) and hot-swaps each new checkpoint into the engine off the
serving path.
"""

from liveloop.server.traces.follower import WeightFollower
from liveloop.server.traces.writer import TraceWriter

__all__ = ["TraceWriter", "WeightFollower"]
