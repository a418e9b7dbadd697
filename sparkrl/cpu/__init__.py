"""The CPU speed layer, an add-on: compiled kernels (`native`, `csrc/`), accelerated modules swapped into a
model (`accelerate`), and the start-up measurements that pick dtypes and kernels on this machine. Nothing
below this package imports it; `train.precision` composes it in."""
