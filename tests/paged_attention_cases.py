"""The shared case builders live in the package so the demo can use them too."""

from pallas_kernels.testing import *  # noqa: F401,F403
from pallas_kernels.testing import __all__  # noqa: F401
