"""warmroute: an OpenAI-compatible LLM proxy that measures what users see and routes to
warm prefix caches."""

__version__ = "0.1.0"
