"""Where rows come from and go to, and what a run may touch there.

- fs.py: paths to pyarrow filesystems; objectstore.py: S3's conditional writes and copies.
- inputs.py: finding and checking the input; sink.py: the Parquet parts; commits.py: which
  rows a run wrote for good.
- output.py: what a run may replace or delete at its output, its staging, publishing;
  lease.py: one run per output; ownership.py: the same rule for every other path.
"""
