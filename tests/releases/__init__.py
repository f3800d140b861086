"""Megatron Core releases and upstream: the release matrix, the doctor, the restated
sources pinned by hash, the patch series of upstream/ and the defects' reproductions."""
