"""Float32 AdamW state for the parameters indexed by the vocabulary, beside a low-bit AdamW elsewhere.

A low-bit AdamW (:func:`optax_memopt.adamw_8bit`, :func:`optax_memopt.adamw_4bit`,
:func:`optax_memopt.adamw_fp8`) stores each block of a moment relative to the
block's absmax. An output-head row scores every token, and the tokens a
fine-tuning corpus never shows get gradients thousands of times smaller than
the row's largest. Squared, their second moment falls under the codes'
smallest non-zero value relative to the block's absmax (3.25e-7 for the
8-bit map: gradients under 1/1750 of the largest; e4m3's
``2**-9 / 448 = 4.4e-6`` sooner) and is stored as 0 while the first moment is
kept: when the next gradient there is smaller, the step is the remembered
``m`` over that gradient alone, hundreds of times AdamW's. Giving these
tensors ``optax.adamw``'s float32 state, with ``optax.partition``, is the
remedy (bitsandbytes keeps embeddings in 32-bit state for the same reason):

.. code-block:: python

  optimizer = optax.partition(
    {
      "quantized": optax_memopt.adamw_8bit(learning_rate, weight_decay=0.01),
      "float32": optax.adamw(learning_rate, weight_decay=0.01),
    },
    optax_memopt.vocabulary_in_float32,
  )

``benchmarks/README.md`` ("Convergence") measures it, and the head alone and
the embedding alone in float32 state.
"""

from __future__ import annotations

from typing import Any, Sequence

import jax
import optax

VOCABULARY_NAMES = ("embed", "lm_head")
QUANTIZED_LABEL = "quantized"
FLOAT32_LABEL = "float32"


def vocabulary_in_float32(params: optax.Params, names: Sequence[str] = VOCABULARY_NAMES) -> Any:
  """Labels ``"float32"`` for the parameters whose path names one of ``names``, ``"quantized"`` for the rest.

  The ``param_labels`` of ``optax.partition`` (see the module's docstring):
  a low-bit AdamW on the ``"quantized"`` group, ``optax.adamw`` on the
  ``"float32"`` one. Worth its cost (8 bytes per parameter of those tensors:
  on Llama-2-7B, whose embedding and head are 3.9% of the parameters, 2.26
  bytes per parameter instead of 2.03 for 8-bit AdamW) when fine-tuning on
  text that uses few of the vocabulary's tokens.

  Args:
    params: the parameters, a pytree (or its shapes).
    names: substrings of ``jax.tree_util.keystr`` of a leaf's path; the
      default, ``("embed", "lm_head")``, names Flax's ``Embed`` and an
      output head called ``lm_head``.

  Returns:
    A pytree of ``params``' structure, ``"float32"`` or ``"quantized"`` per leaf.

  Examples:
    >>> import jax.numpy as jnp
    >>> import optax_memopt
    >>> optax_memopt.vocabulary_in_float32(
    ...     {"embed": {"embedding": jnp.zeros((4, 2))}, "mlp": {"kernel": jnp.zeros((2, 2))}})
    {'embed': {'embedding': 'float32'}, 'mlp': {'kernel': 'quantized'}}
  """
  if isinstance(names, str):
    raise ValueError(f"names must be a sequence of path substrings, not one string; got {names!r}.")
  return jax.tree_util.tree_map_with_path(
    lambda path, _: FLOAT32_LABEL if any(n in jax.tree_util.keystr(path) for n in names) else QUANTIZED_LABEL, params
  )
