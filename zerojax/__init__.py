"""zerojax: DeepSpeed's training engine as JAX shardings."""
from zerojax.config import Config, load_config
from zerojax.errors import ConfigError

__all__ = ["Config", "ConfigError", "load_config"]
__version__ = "0.1.0"
