"""Reuse of earlier outputs: a row whose result key an earlier run's `ok` row has takes
that row's outputs instead of reaching an engine (`sources`: which outputs, proven ours;
`index`: the lookup, on the cluster)."""
