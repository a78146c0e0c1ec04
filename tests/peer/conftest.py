"""The vendored upstream file is executed by the wrapper module, never collected by itself."""

collect_ignore_glob = ["upstream/*"]
