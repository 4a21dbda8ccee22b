"""Suite-wide ordering: the longest modules first, so that two xdist workers (launch/test.sh) finish together
instead of one running the last long module alone. Only the order changes; every test still runs."""

from __future__ import annotations

import pytest

# The longest modules, longest first (measured with --durations on the 2-core CI machine); the rest keep their order.
LONGEST_FIRST = ("test_slurm.py", "test_train.py", "test_train_formats.py", "test_sharded.py", "test_study.py",
                 "test_sst2_formats.py", "test_ffcv_decode.py", "test_eval.py", "test_tracking.py", "test_resume.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: within a module, the file's order
