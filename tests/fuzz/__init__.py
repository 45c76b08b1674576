"""Corpus replay and the compiled/pure differential of the fuzz harnesses (fuzz/README.md)."""
