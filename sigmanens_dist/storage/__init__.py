"""Where the bytes of a dataset come from, torch-free, below the config that validates a ``data.root``: local
paths or HTTP(S) and S3 URLs (:mod:`.remote`: reads retried, read-ahead, uploads) and the count of what arrived
(:mod:`.traffic`). ``data/`` builds its readers and its node-local shard cache on top."""
