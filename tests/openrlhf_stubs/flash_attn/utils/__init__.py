"""TEST-ONLY stand-in (see tests/openrlhf_stubs/README.md)."""
