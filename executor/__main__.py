"""``python -m executor``: the same as ``kvcache-executor`` (see executor.server)."""

import sys

from executor.server import main

sys.exit(main())
