import sys

from cache_service.ctl.cli import main

sys.exit(main())
