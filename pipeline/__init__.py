"""Run large language models over whole corpora, offline: Parquet in, summaries out."""

__version__ = "0.1.0"
