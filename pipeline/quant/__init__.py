"""Low-precision formats the engines serve and the push carries (``fp8``)."""
