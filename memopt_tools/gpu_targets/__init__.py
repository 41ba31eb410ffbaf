"""Descriptions of GPUs that ``memopt_tools.gpu_compile`` compiles for without one.

One ``<name>.pbtxt`` per GPU, each figure cited in its comments: the Hopper
H100 and H200 (sm_90a) and the Blackwell B200 (sm_100a).
"""

NAMES = ("h100", "h200", "b200")
