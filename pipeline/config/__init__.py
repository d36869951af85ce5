"""One typed config per run: the models (models.py) and how files and overrides load into
them (load.py). Import from here: `from pipeline.config import RunConfig, load_run_config`."""

from pipeline.config.load import ConfigError, load_run_config, parse_override
from pipeline.config.models import (
    AdaptivePolicy,
    AnnotationsConfig,
    BatchingConfig,
    BucketingConfig,
    DebugConfig,
    EngineConfig,
    ServerConfig,
    FixedPolicy,
    HardwareConfig,
    InputConfig,
    JobConfig,
    LengthConfig,
    ModelConfig,
    OutputConfig,
    PassagesConfig,
    ProfileConfig,
    PromptConfig,
    RestartConfig,
    RunConfig,
    SamplingConfig,
    TunedPolicy,
)

__all__ = [
    "AdaptivePolicy", "AnnotationsConfig", "BatchingConfig", "BucketingConfig", "ConfigError",
    "DebugConfig", "EngineConfig", "ServerConfig", "FixedPolicy", "HardwareConfig", "TunedPolicy",
    "InputConfig", "JobConfig", "LengthConfig", "ModelConfig", "OutputConfig", "PassagesConfig", "ProfileConfig",
    "PromptConfig", "RestartConfig", "RunConfig", "SamplingConfig", "load_run_config", "parse_override",
]
