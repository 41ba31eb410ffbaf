"""Descriptions of GPUs that ``optax_memopt.gpu_compile`` compiles for without one."""
