"""``python -m sigmanens_dist.experiments.study``: the ``sigmanens study`` command (its parser is
:mod:`sigmanens_dist.cli.study`)."""

import sys

from sigmanens_dist.cli.study import main

sys.exit(main())
