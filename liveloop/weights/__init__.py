"""Policy versions between trainer and servers: the weight transport and the checkpoint format.

`WeightTransport` (write, announce, follow, validate, load) is the one contract trainer and
server share; `SharedDiskTransport` is its implementation (Hugging Face model directories on
a shared disk, announced on `liveloop:weights`; the format is written down in
`liveloop.weights.transport`). `latest_announcement` is the one reader of the newest
announcement.
"""

from liveloop.weights.announcements import (
    decode_announcements,
    latest_announcement,
    latest_announcement_sync,
    recent_announcements,
)
from liveloop.weights.checkpoint import (
    CheckpointError,
    check_checkpoint,
    load_checkpoint_state_dict,
)
from liveloop.weights.transport import (
    SharedDiskTransport,
    WeightTransport,
    adapter_name_of,
    setup_weight_transport,
)

__all__ = [
    "CheckpointError",
    "SharedDiskTransport",
    "WeightTransport",
    "adapter_name_of",
    "check_checkpoint",
    "decode_announcements",
    "latest_announcement",
    "latest_announcement_sync",
    "load_checkpoint_state_dict",
    "recent_announcements",
    "setup_weight_transport",
]
