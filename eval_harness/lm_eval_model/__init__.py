"""Steered models in lm-evaluation-harness: the ``hf-memory`` model type (memory banks + a
selector, CAA vectors + a scale, or a prompt, over lm-eval's ``HFLM``), the offline tasks in
lm-eval's YAML format (``tasks/``), the run that writes our results schema, and its report.

lm-eval finds models only in its own registry (no entry points), so the model type is
registered when :mod:`eval_harness.lm_eval_model.model` is imported: from Python import it
before ``lm_eval.simple_evaluate(model="hf-memory", ...)``; from a shell use
``python -m eval_harness.lm_eval_model`` (lm-eval's own command line, with our model registered)
or ``hf-memory eval lm-eval``.
"""
