"""Fidelity and retrieval evaluations of the FlashPrefill V2 operator on hand-built models.

- :mod:`evals.density`: the density of a CSR index, vectorised (same number as
  ``kernels.reference.density``, usable at 128K on a GPU).
- :mod:`evals.retrieval`: an attention-only needle-retrieval transformer built by hand.
- :mod:`evals.structured_model`: index-stage density of the structured Llama-3.1-8B-shaped model
  (``model_executor.structured_model``, product: the service serves it) whose heads are
  constructed to show sinks, locality and retrieval, for density measurements.
"""
