"""TEST-ONLY stand-in (see tests/openrlhf_stubs/README.md)."""


class TokensPrompt(dict):
    """vLLM's TokensPrompt is a TypedDict: a plain dict here."""
