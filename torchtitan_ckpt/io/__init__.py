"""The I/O engine: how checkpoint files are written, read, checked and trusted."""

IO_THREADS = 4
"""Threads per rank reading, writing or checking files, by default (`checkpoint.load_threads`,
`checkpoint.consolidation_threads`, the command line's `--threads`)."""
