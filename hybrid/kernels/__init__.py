"""CPU kernels and the native helpers they depend on."""
