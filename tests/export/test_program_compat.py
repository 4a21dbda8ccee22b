"""Every program of format version 1 reads: ``tests/fixtures/program_v1`` is a ``sigmanens-program/1`` ``.pt2``
written at version 0.3.0 (its README.md says how), which ``sigmanens predict``'s loader must keep vetting, reading and
running to the outputs it gave when written."""

from __future__ import annotations

import torch

from sigmanens_dist.predict.backends import load_program
from sigmanens_dist.program_meta import OUTPUTS
from tests.helpers import REPO

STORED = REPO / "tests" / "fixtures" / "program_v1"


def test_a_stored_version_1_program_predicts_what_it_predicted() -> None:
    program = load_program(STORED / "program.pt2", torch.device("cpu"))
    meta = program.meta
    assert (meta.format_version, meta.package_version, meta.program_format, meta.weights) == (1, "0.3.0", "torch",
                                                                                             "raw")
    assert (meta.num_classes, meta.members, meta.input.chw, meta.calibration) == (10, [0, 1], (3, 16, 16), "none")
    expected = torch.load(STORED / "expected.pt", weights_only=True)
    got = program(expected["input"])
    assert list(got) == list(OUTPUTS)
    for name in OUTPUTS:
        torch.testing.assert_close(torch.from_numpy(got[name]), expected[name], rtol=1e-5, atol=1e-6, msg=name)
