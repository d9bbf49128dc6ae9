"""paratrain: train large language models across many processes."""

__version__ = "0.1.0"
