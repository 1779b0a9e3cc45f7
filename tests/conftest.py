"""Eight virtual CPU devices for every test, set before JAX starts, cheap compiles and a persistent compile cache."""
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests run tiny programs once or a few times: XLA's backend optimizations (LLVM -O2 and its
# expensive passes) cost more compile time than they save. Floating-point semantics are the same,
# and processes the tests start (train.py, the CLI) inherit it from the environment.
os.environ.setdefault("JAX_DISABLE_MOST_OPTIMIZATIONS", "1")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 8)
_cache = os.environ.get("ZEROJAX_TEST_CACHE", os.path.join(os.path.dirname(__file__), "..", ".cache", "jax"))
jax.config.update("jax_compilation_cache_dir", os.path.abspath(_cache))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
# The same cache for the processes tests start (train.py, the CLI), which read JAX's options from the
# environment: the many small runs of one config then compile its step once.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.abspath(_cache))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
