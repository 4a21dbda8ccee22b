"""``python -m sigmanens_dist.experiments.compare``: the ``sigmanens compare`` command (its parser is
:mod:`sigmanens_dist.cli.compare`)."""

import sys

from sigmanens_dist.cli.compare import main

sys.exit(main())
