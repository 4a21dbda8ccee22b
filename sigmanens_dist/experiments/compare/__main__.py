"""``python -m sigmanens_dist.experiments.compare``: the ``sigmanens compare`` command."""

import sys

from sigmanens_dist.experiments.compare.cli import main

sys.exit(main())
