"""The MTP head trainer: self-distillation of a draft head from a target model.

``run.train_head`` / ``run.eval_head`` take a config (``config``) and a target loader; the
target is the caller's (``target.Target``: the runner supplies one built on its own model
code), so this package never imports the runner. ``cli`` parses ``mtp-runner train-head``
and ``mtp-runner eval-head``.
"""
