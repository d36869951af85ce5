"""The benchmarks: beside the package, not in it. `python -m bench` compares the pipeline
with raw vLLM and Ray Data LLM (compare.py); the other modules measure one thing each
(`make bench-*`), with results under results/ and README.md."""
