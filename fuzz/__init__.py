"""Coverage-guided fuzz harnesses of aiobrpc (atheris); see fuzz/README.md."""
