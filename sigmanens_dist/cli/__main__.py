"""``python -m sigmanens_dist.cli COMMAND …``: the ``sigmanens`` command without its console script."""

import sys

from sigmanens_dist.cli import main

sys.exit(main())
