"""Where weights come from: a safetensors checkpoint on disk or a preset's seeded random tensors,
behind one interface, and the one routine that fills a model's parameters from either."""
