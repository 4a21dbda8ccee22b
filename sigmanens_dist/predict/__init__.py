"""``sigmanens predict PROGRAM INPUTS... --out DIR``: an exported program (``.pt2`` or ``.onnx``) over image files,
folders, webdataset shards and FFCV files, on one process or under torchrun, resumable unit by unit
(docs/deploy.md, "Predicting over many inputs"). Above export/: it runs what export/program.py writes, and reads
its metadata with program_meta.py alone (never the evaluation code).

* :mod:`.inputs`: finding the inputs, cutting them into units, reading and decoding them, the shape check;
* :mod:`.backends`: loading a program safely and calling it;
* :mod:`.writer`: the output folder (manifest, part files, summary);
* :mod:`.run`: the loop over this rank's units.
"""

from sigmanens_dist.predict.run import predict

__all__ = ["predict"]
