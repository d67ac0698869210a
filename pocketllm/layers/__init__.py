"""Model building blocks. TP layers own their shard: each parameter lists the checkpoint tensors
(and the part of each) it is filled from, so loading needs no model-specific hooks."""
