"""One module per CLI word, built from the shared option factories in options.py."""
