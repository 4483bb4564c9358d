"""The Hydra config tree; importing it registers the schemas."""
from moe_exp import config as _config  # noqa: F401
