"""``python -m sigmanens_dist.experiments.study``: the ``sigmanens study`` command."""

import sys

from sigmanens_dist.experiments.study.cli import main

sys.exit(main())
