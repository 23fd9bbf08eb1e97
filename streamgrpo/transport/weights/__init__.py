"""The weight channel: :mod:`.base` (``WeightSync`` / ``WeightSyncClient``), :mod:`.factory` (the one
reader of ``weights.transport``), the ZeroMQ backend (:mod:`.publisher`, :mod:`.subscriber`), the
shared-memory backend built on it (:mod:`.shm_publisher`, :mod:`.shm_subscriber`, :mod:`.shm`), and
their pure parts (:mod:`.layout`, :mod:`.codec`), sockets (:mod:`.sockets`, :mod:`.links`) and CURVE
keys (:mod:`.keys`). Nothing is imported here."""
