"""TEST-ONLY stand-in for flash-attn (see tests/openrlhf_stubs/README.md); never used outside tests."""

__version__ = "0.0.0+rlwatch.test.stub"
