"""Weight formats as published: FP8 E4M3 block tensors (quantise, dequantise). Pure torch; the lowest layer."""
