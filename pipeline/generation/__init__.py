"""The generation core: a library. Requests go in (row position, token ids, sampling);
completions come out. It imports no config models, no Ray and no Arrow.

- engine.py: the engine Protocol and the plain data it passes; vllm.py: vLLM as one engine.
- feeder.py: keeps one engine fed with one bucket's rows, within a batch policy, and recovers.
- tasks.py: summarize, annotate with a retry, and map-reduce, as functions over a feeder.
- policy/: the batch policies (adaptive, fixed); memory.py: the pressure probe they read.
"""
