"""Pipeline stages: plain classes whose constructor loads state once and whose
call maps a pyarrow batch to a pyarrow batch. The same object runs under Ray
Data's `map_batches` and in a unit test."""
