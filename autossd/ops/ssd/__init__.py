"""The SSD forward: `naive` (float64 references) beside `chunk` (the generated kernels)."""
