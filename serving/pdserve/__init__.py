"""pdserve: pdstack's bundled serving runtime.

Subpackages:
  engine  -- the reference numpy inference engine (model loading, batched forward, KV cache, sampling).
"""

__version__ = "0.1.0"
