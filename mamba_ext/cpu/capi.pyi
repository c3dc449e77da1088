"""C API table of mamba_ext (include/mamba_ext/mamba_ext.h), exported as a capsule."""
from typing import Any, Final

_C_API: Final[Any]          # PyCapsule "mamba_ext.cpu.capi._C_API" -> const mamba_ext_api*
ABI_VERSION: Final[int]
API_COUNT: Final[int]

def abi_version() -> int: ...
def api_count() -> int: ...
