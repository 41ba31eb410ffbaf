"""memopt_tools: the tools around the optax_memopt library.

The main job (:mod:`memopt_tools.main_job`), the memory planner
(:mod:`memopt_tools.fit`), the GPU compile (:mod:`memopt_tools.gpu_compile`,
:mod:`memopt_tools.train_compile`, the GPU descriptions in ``gpu_targets/``)
and the training task they share (:mod:`memopt_tools.training`). The tools
import the library (``optax_memopt``, ``pallas_kernels``); the library imports
nothing from here.
"""
