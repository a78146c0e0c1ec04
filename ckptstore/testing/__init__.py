"""Test helpers shipped with ckptstore: the backend conformance suite and
fault-injecting wrappers, so a third-party backend can prove itself."""
