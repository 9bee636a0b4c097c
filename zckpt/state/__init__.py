"""Layer 4, state: the format-neutral training-state model (:mod:`zckpt.state.model`) every format's reader
produces and every writer consumes; the one opener (:mod:`zckpt.state.open`), which asks each format's reader
whether a path is its own; and the input check of a checkpoint (:mod:`zckpt.state.checksums`)."""
