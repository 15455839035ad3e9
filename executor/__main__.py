"""``python -m executor``: the same as ``kvcache-executor`` (see executor.cli)."""

import sys

from executor.cli import main

sys.exit(main())
