"""Batch policies: how many rows (and tokens) each length bucket may have in flight."""

from pipeline.generation.policy.adaptive import BatchSizeController, ControllerSettings, static_batch_settings
from pipeline.generation.policy.base import BatchPolicy, Observation
from pipeline.generation.policy.fixed import FixedBatchPolicy

__all__ = ["BatchPolicy", "BatchSizeController", "ControllerSettings", "FixedBatchPolicy", "Observation",
           "static_batch_settings"]
