"""Quantized linear methods (see ``layers/linear.py``'s ``LinearMethod``): FP8 in ``fp8.py``."""
