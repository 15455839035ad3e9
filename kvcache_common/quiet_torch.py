"""Import before torch: silences torch's "Failed to initialize NumPy" warning, and only it.

torch warns (2 lines on stderr, at its first import) when numpy is not installed. Nothing here
converts tensors to numpy, so numpy stays out of the dependencies (and of the images: it would
be the largest wheel after torch) and the warning goes instead. The filter matches the
message, the category and torch's modules only: every other warning still shows.
"""

from __future__ import annotations

import warnings

warnings.filterwarnings("ignore", message=r"Failed to initialize NumPy", category=UserWarning,
                        module=r"torch(\.|$)")
