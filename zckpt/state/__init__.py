"""The format-neutral training-state model (:mod:`zckpt.state.model`): what every reader (DeepSpeed, DCP)
produces and every writer consumes."""
