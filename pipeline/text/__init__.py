"""Pure text algorithms, no I/O: prompt-length buckets (bucketing.py), truncation and
windows over token ids (length.py), and the annotation schema's JSON to Arrow
(annotations.py)."""
