"""autossd: generated, tuned Triton kernels for the Mamba-2 SSD layer."""
from .arch import ARCHS, Arch, get_arch, local_arch
from .ops.ssd.chunk import ssd_forward
from .problem import Problem, from_args
from .runtime import Kernel, clear_cache, get_kernel, mamba_chunk_scan_combined
from . import grad  # noqa: F401,E402 - registers the forward's backward (eager calls and the custom op)
from .ops.ssd.decode import selective_state_update
from .ops.ssd.varlen import mamba_chunk_scan_combined_varlen, ssd_varlen, varlen_chunks
from .ops.ssd.split_conv1d import mamba_split_conv1d_scan_combined
from .ops.mamba1.scan import selective_scan_fn
from .ops.ssd.fwd_knobs import KNOBS, Config, ConfigError, default_config
from .ops.mamba1.inner import mamba_inner_fn

__version__ = "0.1.0"
__all__ = ["ARCHS", "Arch", "Config", "ConfigError", "KNOBS", "Problem", "default_config",
           "from_args", "get_arch", "local_arch", "ssd_forward", "__version__", "mamba_inner_fn",
           "Kernel", "clear_cache", "get_kernel", "mamba_chunk_scan_combined", "selective_state_update",
           "ssd_varlen", "mamba_chunk_scan_combined_varlen", "varlen_chunks",
           "mamba_split_conv1d_scan_combined", "selective_scan_fn"]
