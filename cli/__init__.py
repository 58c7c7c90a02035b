"""The command line: the top layer (may import every other package)."""
