"""The block layer: the versioned block store, shared-memory arenas, and the codecs with
their block header (the wire format of a block)."""
