"""Everything the project names once, torch-free, below the config that validates against it: the datasets
(:mod:`.datasets`: what each is, its statistics, its default root, whether it converts) and the corruptions
(:mod:`.corruption_table`: names, severities, the test and validation shift sets). ``data/`` reads and corrupts
the data these names describe."""
