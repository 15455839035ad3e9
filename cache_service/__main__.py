"""``python -m cache_service``: the same as ``kvcache-server`` (see cache_service.server)."""

import sys

from cache_service.server import main

sys.exit(main())
