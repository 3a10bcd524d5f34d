"""Self-distillation training of MTP draft heads (used by scripts/train_mtp_head.py and
scripts/eval_head.py): prompt set, batched generation with captured hiddens, the data set,
the training loop and the sidecar writer/reader."""
