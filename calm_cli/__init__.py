"""The `calm` command line: the composition root that wires core, training, adapters and gateway together."""
