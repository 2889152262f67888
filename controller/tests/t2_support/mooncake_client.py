"""A real Mooncake store client (the wheel's `mooncake.store`, the one engines embed): mounts a
host-memory segment on the master over TCP, puts and gets one object, then stays up (holding
its segment) until stdin closes.

    python3 mooncake_client.py <wheel-dir> <local-ip> <master-host>

Prints `mounted` once the put/get round-tripped.
"""

import sys

sys.path.insert(0, sys.argv[1])
from mooncake.store import MooncakeDistributedStore  # noqa: E402

local, master = sys.argv[2], sys.argv[3]
store = MooncakeDistributedStore()
rc = store.setup(
    local,
    f"http://{master}:8080/metadata",
    64 * 1024 * 1024,  # global segment: what the master counts as capacity
    16 * 1024 * 1024,  # local buffer
    "tcp",
    "",
    f"{master}:50051",
)
if rc != 0:
    sys.exit(f"setup failed: {rc}")
if store.put("inferencecache-test", b"hello") != 0 or store.get("inferencecache-test") != b"hello":
    sys.exit("put/get through the store failed")
print("mounted", flush=True)
sys.stdin.read()
store.close()
