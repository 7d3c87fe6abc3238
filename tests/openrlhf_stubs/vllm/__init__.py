"""TEST-ONLY stand-in for vLLM (see tests/openrlhf_stubs/README.md): just enough for OpenRLHF's
modules to import on CPU. No engine: the tests generate with a small CPU stand-in actor."""

__version__ = "0.0.0+rlwatch.test.stub"


class SamplingParams:
    """Stores its keyword arguments as attributes, like vLLM's (no validation)."""

    def __init__(self, temperature: float = 1.0, top_p: float = 1.0, top_k: int = -1, max_tokens=16,
                 min_tokens: int = 0, skip_special_tokens: bool = True, logprobs=None, **kwargs) -> None:
        self.temperature = temperature
        self.top_p = top_p
        self.top_k = top_k
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens
        self.skip_special_tokens = skip_special_tokens
        self.logprobs = logprobs
        for key, value in kwargs.items():
            setattr(self, key, value)

    def __repr__(self) -> str:
        return f"SamplingParams({vars(self)})"
