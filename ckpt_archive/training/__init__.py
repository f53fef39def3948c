"""Progress versus policy: what a checkpoint will really do to the next optimizer step.

A checkpoint carries *progress* (moments, counters, RNG, data cursor) and, hidden inside the optimizer's
``param_groups``, a *policy* (learning rate, weight decay, ...). ``optimizer.load_state_dict`` restores
both, so a session that lowered its LR in its config silently trains with the archived one; an optimizer
loaded before its scheduler was built silently trains with the scheduler's warm-up value. This package
makes those facts visible and gives a restore that does them in the right order. Where things are:

* :mod:`~ckpt_archive.training.parts`: the parts of a resume point and where they sit (``find_parts``),
  RNG stream detection, the tensor test; shared with :mod:`ckpt_archive.resume`.
* :mod:`~ckpt_archive.training.schedulers`: the scheduler class from its state (``scheduler_kind``) and
  its closed-form LR (``derive_lrs``).
* :mod:`~ckpt_archive.training.audit`: ``audit`` -> ``PolicyAudit`` (the LR the next step uses, counters,
  findings); :mod:`~ckpt_archive.training.completeness`: ``lint_completeness`` and ``policy_section``.
* :mod:`~ckpt_archive.training.session_config`: what a config asks for (``session_values``, the per-group
  spread, a hand-written LR schedule); :mod:`~ckpt_archive.training.plan`: what it asks of each
  optimizer/scheduler pair; :mod:`~ckpt_archive.training.nextstep`: the one model of the next optimizer steps
  under either policy (real torch), behind every LR message.
* :mod:`~ckpt_archive.training.session`: ``compare_with_session``; :mod:`~ckpt_archive.training.impose`:
  ``apply_session_policy``, ``impose_lrs``.
* :mod:`~ckpt_archive.training.restore`: ``restore_training_state`` (checks in
  :mod:`~ckpt_archive.training.structure`, RNG in :mod:`~ckpt_archive.training.rng_restore`).
* :mod:`~ckpt_archive.training.values`: numbers from a state, LR tolerances, value formatting.

Everything here works on the plain nested state (as returned by ``torch.load(weights_only=True)`` or
:func:`ckpt_archive.load`); nothing is unpickled (the next-step model rebuilds scheduler objects from plain
state on a dummy optimizer), and nothing reads an archive (:mod:`ckpt_archive.ops.audit_read` does), judges a
generation (:mod:`ckpt_archive.ops.policy_check` does) or prints (:mod:`ckpt_archive.cli.policy_views` does).
"""
